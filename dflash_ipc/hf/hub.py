"""Hub ids where a model or a dataset is named: `Qwen/Qwen3-8B` as well as a local directory.

Every place that names a model (`target.path`, `drafter.init_from`, `prepare`/`regenerate
--model`, `eval --target/--drafter`) or a dataset (`prepare`/`regenerate --input`, `eval
--prompts`) passes it through `resolve_model` or `resolve_dataset` first. A name that is an
existing local path is returned as it is; one that is not and reads `ORG/NAME` is a Hub
repository, brought into huggingface_hub's own cache (`HF_HUB_CACHE`, default
`~/.cache/huggingface/hub`) by `snapshot_download` and returned as its snapshot directory.
Anything else is returned unchanged, for the caller's own "not found" error.

Datasets come through `snapshot_download` too (repo type "dataset"), not `datasets.load_dataset`:
the repository's Parquet/JSON(L) files then go through the same reader as a local directory of
shards (data/reader.py: its split rules, rejects and fingerprint), and nothing a repository
holds is run. Only the files this project reads are fetched: weights, configs and tokenizer
files of a model, data files of a dataset.

`HF_HUB_OFFLINE=1` (read when called, so a test or a shell can set it late) looks in the cache
only; a repository that is not there is one error saying so and how to download it.
"""

from __future__ import annotations

import logging
import os
import re

from dflash_ipc.errors import ConfigError

log = logging.getLogger(__name__)

# huggingface_hub's repo id rules: ORG/NAME, letters, digits, '-', '_', '.'; no '--' or '..'.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")
DATASET_FILES = ("*.parquet", "*.jsonl", "*.json")
DATASET_SIDE_FILES = ("dataset_info*.json", "dataset_infos.json", "**/dataset_info*.json")  # metadata, not rows
_TRUE = {"1", "on", "yes", "true"}


def is_hub_id(name: str) -> bool:
    """True when `name` is not a local path and reads as a Hub repository id."""
    return (isinstance(name, str) and not os.path.exists(name) and bool(HUB_ID.match(name))
            and "--" not in name and ".." not in name)


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def cache_dir() -> str:
    """Where huggingface_hub keeps repositories (its own variables, read now)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                     os.path.expanduser("~/.cache"), "huggingface")
    return os.path.join(home, "hub")


def resolve_model(name: str, *, what: str) -> str:
    """The local directory of model `name` (a path, or a Hub id fetched into the cache);
    `what` names the key or option in errors (`target.path`, `--model`). A name that is neither
    is an error here, not transformers' complaint about repository ids further on."""
    if isinstance(name, str) and not os.path.exists(name) and not is_hub_id(name):
        raise ConfigError(f"{what}: {name}: no such model directory (give a local directory, or a Hub id "
                          "ORG/NAME)")
    return _resolve(name, what=what, repo_type="model", allow=MODEL_FILES, ignore=())


def resolve_dataset(name: str, *, what: str) -> str:
    """The local path of dataset `name` (a path, or a Hub dataset id fetched into the cache)."""
    return _resolve(name, what=what, repo_type="dataset", allow=DATASET_FILES, ignore=DATASET_SIDE_FILES)


def _resolve(name: str, *, what: str, repo_type: str, allow: tuple[str, ...], ignore: tuple[str, ...]) -> str:
    if not is_hub_id(name):
        return name
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    download = f"hf download {name}{' --repo-type dataset' if repo_type == 'dataset' else ''}"
    cache = cache_dir()
    try:
        path = snapshot_download(name, repo_type=repo_type, cache_dir=cache, local_files_only=offline(),
                                 allow_patterns=list(allow), ignore_patterns=list(ignore) or None)
    except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise ConfigError(f"{what}: {name} is neither a local path nor a {repo_type} on the Hugging Face Hub "
                          f"this account can read ({type(exc).__name__}; gated: accept its terms and "
                          f"`hf auth login`)") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1" if offline() else "the Hub cannot be reached"
        raise ConfigError(f"{what}: {name} is not a local path and not in the Hugging Face cache ({cache}), "
                          f"and {why}: download it first with `{download}` where the Hub is reachable "
                          f"(the same HF_HUB_CACHE), or give a local directory") from None
    except (HfHubHTTPError, OSError) as exc:
        raise ConfigError(f"{what}: downloading {name} from the Hugging Face Hub failed ({str(exc)[:200]}); "
                          f"retry, or download it with `{download}`") from None
    log.info("%s: %s is %s", what, name, path)
    return path
