"""The bench tests; a figure file is a real PNG when it starts with PNG_MAGIC."""

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
