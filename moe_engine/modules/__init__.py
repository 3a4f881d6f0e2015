"""Dense building blocks of the transformer."""
