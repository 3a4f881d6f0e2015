"""Conversions between the engine and other implementations (transformers), kept out of the core imports."""
