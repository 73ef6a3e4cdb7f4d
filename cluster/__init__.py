"""Where things run: draft and target as Ray actors on separate resource groups.

`ClusterConfig` / `GroupConfig` say where (config.py, no Ray import); the
actors (actors.py), their placement (placement.py), the coordinator's proxies
(remote.py), the wire format (messages.py) and the `ray job submit` entrypoint
(job.py) import Ray only when used.
"""

from specdec.cluster.config import ClusterConfig, GroupConfig

__all__ = ["ClusterConfig", "GroupConfig"]
