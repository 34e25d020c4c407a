"""On-disk format v1: manifest dataclasses, data-file layout, dtype and object codecs.

Normative specification: docs/FORMAT.md.
"""

FORMAT_NAME = "quicksave"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DCP_METADATA_NAME = ".metadata"
ALIGNMENT = 4096
