"""On-disk format (manifest versions 1 and 2): manifest dataclasses, data-file layout,
dtype and object codecs.

Normative specification: docs/FORMAT.md.
"""

FORMAT_NAME = "quicksave"
FORMAT_VERSION = 1  # data file headers, and manifests without chunk references
FORMAT_VERSION_REFS = 2  # a manifest with chunk references (FORMAT.md §9)
READ_VERSIONS = (FORMAT_VERSION, FORMAT_VERSION_REFS)  # the manifest versions read
MANIFEST_NAME = "manifest.json"
DCP_METADATA_NAME = ".metadata"
ALIGNMENT = 4096
