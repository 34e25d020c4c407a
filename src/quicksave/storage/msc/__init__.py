"""The Multi-Storage Client backend: one MSC profile (``msc://<profile>/<key>``).

NVIDIA's Multi-Storage Client (package ``multi-storage-client``, ``pip install
'quicksave[msc]'``) reaches S3, GCS, Azure, OCI, AIStore, POSIX and more through named
*profiles* in a YAML/JSON config file. This backend drives one profile through MSC's
public :class:`~multistorageclient.StorageClient` API, so whatever the profile configures
(its provider, credentials provider, retry policy, cache, replicas, the provider's
``multipart_threshold`` / ``multipart_chunksize`` / ``max_concurrency``, the Rust client)
applies to quicksave's I/O as it does to any other MSC user.

Config lookup is MSC's own: ``StorageOptions.msc_config`` names the file; without it MSC
searches ``$MSC_CONFIG``, then its default paths (``~/.msc_config.yaml``,
``~/.config/msc/config.yaml``, ``/etc/msc_config.yaml``, ...), exactly as
``msc.resolve_storage_client("msc://<profile>/...")`` does. An S3 profile for an
S3-compatible server (SeaweedFS, MinIO) looks like::

    profiles:
      ckpt:
        storage_provider:
          type: s3
          options:
            base_path: my-bucket            # bucket[/prefix]
            endpoint_url: http://127.0.0.1:8333
            region_name: us-east-1
            s3: {addressing_style: path}    # path-style URLs for a custom endpoint
        credentials_provider:
          type: S3Credentials
          options: {access_key: ..., secret_key: ...}

The backend is a *store* (``atomic_rename = False``) whatever the provider, POSIX
included: a checkpoint is committed by writing its manifest last.

How bytes move:

- ``put`` hands MSC a read-only, seekable file object over the caller's memoryview
  (``StorageClient.upload_file``). Objects up to the provider's ``multipart_threshold``
  (S3: 64 MiB by default) become one PUT; MSC reads them with ``f.read()``, which is one
  copy of the object (botocore takes ``bytes`` but not a memoryview). Larger ones are
  uploaded by boto3's transfer manager in ``multipart_chunksize`` parts, several in
  flight; it reads each part with ``f.read(part_size)``: one memcpy per byte, in
  part-sized pieces, at most about ten parts (s3transfer's
  ``max_in_memory_upload_chunks``) held at once, never a second whole-object buffer.
  No public MSC call takes a memoryview without that copy. The ranges' xxh3-64 are
  computed meanwhile on another thread (xxhash releases the GIL).
- ``read_into`` issues ranged reads (``StorageClient.read(byte_range=...)``), several in
  parallel on a thread pool owned by the backend for large ranges. MSC returns each range
  as a new ``bytes``, which is copied into the destination: one extra memcpy per byte.

Modules: :mod:`~quicksave.storage.msc.backend` (:class:`MscBackend`, the protocol's
operations), :mod:`~quicksave.storage.msc.config` (finding the config, its secrets, making
MSC's client), :mod:`~quicksave.storage.msc.errors` (what a failure says).

Torch-free, and ``multistorageclient`` is imported only when a backend is created.
"""

from quicksave.storage.msc.backend import MscBackend

__all__ = ["MscBackend"]
