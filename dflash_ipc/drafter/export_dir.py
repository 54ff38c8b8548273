"""The directory an export is written to: the files an export holds, and what may be replaced.

An export replaces its output directory whole (written aside, then renamed into place), so a
mistyped OUT_DIR must never name someone's files: only an absent or empty directory, or an
earlier export, is replaced. Kept free of torch so `dflash-ipc export` refuses a wrong OUT_DIR
before it imports anything heavy (drafter/inference_format.py writes the export itself).
"""

from __future__ import annotations

import os

from dflash_ipc.errors import DataError
from dflash_ipc.run.json_files import read_json_object

ARCHITECTURE = "DFlashDraftModel"  # config.json "architectures" of an export (drafter/model.py's class)
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Every file an export may hold: the two above, the model card (export/model_card.CARD_FILE)
# and --with-code's module (export/hub_code.MODELING_FILE). A directory holding anything else
# is not an earlier export, and export never replaces it.
EXPORT_FILES = (CONFIG_FILE, WEIGHTS_FILE, "README.md", "modeling_dflash.py")


def check_export_target(out_dir: str) -> None:
    """`out_dir` may be written: it does not exist, is empty, or is an earlier export (only
    EXPORT_FILES, a config.json of our architecture), which the new one replaces. Anything
    else is the user's, and nothing of it is removed: DataError."""
    if not os.path.lexists(out_dir):
        return
    if os.path.islink(out_dir) or not os.path.isdir(out_dir):
        raise DataError(f"{out_dir}: exists and is not a directory; give a new or empty directory to export to")
    names = sorted(os.listdir(out_dir))
    if not names:
        return
    unknown = [n for n in names if n not in EXPORT_FILES]
    refuse = (f"{out_dir}: exists and is not an earlier export (%s); nothing in it is removed: give a new or empty "
              f"directory to export to, or remove it yourself")
    if unknown:
        raise DataError(refuse % f"it holds {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
    cfg_path = os.path.join(out_dir, CONFIG_FILE)
    try:
        architectures = read_json_object(cfg_path, "an earlier export's config").get("architectures")
    except DataError as e:
        raise DataError(refuse % f"{CONFIG_FILE}: {str(e)[len(cfg_path) + 2:][:200]}") from None
    if architectures != [ARCHITECTURE]:
        raise DataError(refuse % f"its {CONFIG_FILE} has architectures {str(architectures)[:80]}, not [{ARCHITECTURE!r}]")
