"""The I/O shell: the ASGI gateway (`app`), `kvgate serve` (`cli`) and the shell's settings,
grouped by concept into `http`, `relay`, `engines`, `security` and `ops`."""
