"""One module per ``moe-bench`` command (``register`` adds its parser; its handler does the work);
``common`` holds what they share. The entry point is ``bench.cli``."""
