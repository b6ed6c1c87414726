"""The jail: nsjail's configuration and launch, per-job cgroups, the spawner thread,
network namespaces and the UID pool.

Below everything else in the runner: it imports only ``config``, ``errors`` and
``languages``.
"""
