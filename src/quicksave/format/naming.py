"""Names of the files inside a checkpoint: what a member name may be. Pure checks, no I/O."""

from __future__ import annotations


def bad_member_name(name: object) -> str | None:
    """Why ``name`` is not a plain file name inside a directory, or None if it is."""
    if not isinstance(name, str):
        return "not a string"
    if name in ("", ".", ".."):
        return "not a file name"
    if "/" in name or "\\" in name:
        return "contains a path separator"
    if "\x00" in name:
        return "contains a NUL character"
    if len(name.encode("utf-8", "surrogatepass")) > 255:
        return "longer than 255 bytes"
    return None
