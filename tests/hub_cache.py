"""A Hugging Face cache laid out as huggingface_hub lays it out, for tests without network:

    HF_HUB_CACHE/models--ORG--NAME/blobs/<sha256>             the files' bytes
    HF_HUB_CACHE/models--ORG--NAME/snapshots/<rev>/<path>     symlinks into blobs/
    HF_HUB_CACHE/models--ORG--NAME/refs/main                  <rev>
(`datasets--ORG--NAME` for datasets)."""

import hashlib
import os

REVISION = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache, repo_id: str, source: str, *, repo_type: str = "model") -> str:
    """Puts every file under the directory `source` into `cache` as repo `repo_id`; returns
    the snapshot directory huggingface_hub resolves it to."""
    kind = {"model": "models", "dataset": "datasets"}[repo_type]
    root = os.path.join(str(cache), f"{kind}--{repo_id.replace('/', '--')}")
    snapshot = os.path.join(root, "snapshots", REVISION)
    os.makedirs(os.path.join(root, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    for folder, _, names in os.walk(source):
        for name in names:
            data = open(os.path.join(folder, name), "rb").read()
            blob = os.path.join(root, "blobs", hashlib.sha256(data).hexdigest())
            with open(blob, "wb") as f:
                f.write(data)
            link = os.path.join(snapshot, os.path.relpath(os.path.join(folder, name), source))
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    with open(os.path.join(root, "refs", "main"), "w") as f:
        f.write(REVISION)
    return snapshot
