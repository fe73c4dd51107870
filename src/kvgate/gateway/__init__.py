"""The I/O shell: the ASGI gateway, its relay, its servers and its `kvgate serve` command."""
