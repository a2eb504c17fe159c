"""Finding a running cluster to attach to: a profile name, a profile folder, or a connection file.

``nbddp.start(profile=..., cluster_id=...)`` accepts what people have at hand
after ``ipcluster start`` or ``ipcontroller``; this module turns it into the
files ipyparallel reads, or an error that says what was looked for and what
was found instead.
"""

from __future__ import annotations

import os

from nbddp.protocol.errors import ClusterError


def attach_files(profile: str | None, cluster_id: str | None) -> tuple[str, str, str | None]:
    """(profile directory, client connection file, cluster file or None) for ``attach``."""
    if profile is not None and not isinstance(profile, (str, os.PathLike)):
        raise TypeError(f"start(profile=...) must be a profile name or a path, got {type(profile).__name__} {profile!r}")
    if cluster_id is not None and not isinstance(cluster_id, str):
        raise TypeError(f"start(cluster_id=...) must be a str, got {type(cluster_id).__name__} {cluster_id!r}")
    cid = cluster_id or ""
    raw = os.fspath(profile) if profile is not None else "default"
    expanded = os.path.abspath(os.path.expanduser(raw))
    if raw.endswith(".json"):
        if not os.path.isfile(expanded):
            raise ClusterError(f"start(profile={raw!r}): no such connection file. Pass the path of the "
                               "ipcontroller-<cluster_id>-client.json file the controller wrote in <profile>/security/.")
        return os.path.dirname(os.path.dirname(expanded)), expanded, None
    if os.sep in raw or raw.startswith("~") or os.path.isdir(expanded):
        profile_dir = expanded
    else:
        from IPython.paths import get_ipython_dir

        profile_dir = os.path.join(get_ipython_dir(), f"profile_{raw}")
    security = os.path.join(profile_dir, "security")
    cluster_file = os.path.join(security, f"cluster-{cid}.json")
    client_file = os.path.join(security, f"ipcontroller-{cid}-client.json" if cid else "ipcontroller-client.json")
    if os.path.isfile(cluster_file):
        return profile_dir, client_file, cluster_file
    if os.path.isfile(client_file):
        return profile_dir, client_file, None
    found = sorted(name[len("ipcontroller-"):-len("-client.json")] or "''"
                   for name in (os.listdir(security) if os.path.isdir(security) else [])
                   if name.startswith("ipcontroller-") and name.endswith("-client.json"))
    hint = (f"cluster ids found there: {', '.join(found)}; pass cluster_id=..." if found
            else "no cluster was started with this profile; start one with `ipcluster start -n N` "
                 f"(--profile-dir={profile_dir!r}), or check the path")
    raise ClusterError(f"cannot attach with profile={raw!r}, cluster_id={cluster_id!r}: neither {cluster_file} "
                       f"nor {client_file} exists ({hint}).")
