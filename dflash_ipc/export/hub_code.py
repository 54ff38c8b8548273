"""What `dflash-ipc export` adds beside the weights for publishing: the model card and, with
`--with-code`, the code that lets plain transformers load the drafter.

    export/
      config.json          SGLang / vLLM keys (export.CONFIG_KEYS); with --with-code also
                           "auto_map": {"AutoModel": "modeling_dflash.DFlashDraftModel"}
      model.safetensors
      README.md            model_card.py
      modeling_dflash.py   --with-code: hub_modeling.py as is (torch + transformers only)

Then `AutoModel.from_pretrained(export, trust_remote_code=True)` builds the drafter and
`draft.spec_generate(target, input_ids, max_new_tokens)` decodes with it. `auto_map` is the
only key added to config.json, and only with --with-code: SGLang and vLLM ignore it.
"""

from __future__ import annotations

import importlib.resources
import json
import os
from collections.abc import Callable

from dflash_ipc.drafter.inference_format import CONFIG_FILE
from dflash_ipc.export.model_card import write_model_card

MODELING_FILE = "modeling_dflash.py"
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}


def add_hub_code(export_dir: str) -> None:
    """Writes `modeling_dflash.py` and adds `auto_map` to `export_dir/config.json`."""
    source = importlib.resources.files("dflash_ipc.export").joinpath("hub_modeling.py").read_text(encoding="utf-8")
    with open(os.path.join(export_dir, MODELING_FILE), "w", encoding="utf-8") as f:
        f.write(source)
    path = os.path.join(export_dir, CONFIG_FILE)
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["auto_map"] = dict(AUTO_MAP)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def publish_files(step_dir: str, out_dir: str, *, with_code: bool = False, base_model: str | None = None,
                  repo_id: str | None = None) -> Callable[[str], None]:
    """The `extras` of `export_training_checkpoint`: writes the card (and the code) into the
    export's temporary directory, so the export appears complete or not at all."""
    repo = repo_id or os.path.basename(os.path.normpath(out_dir))

    def write(tmp_dir: str) -> None:
        if with_code:
            add_hub_code(tmp_dir)
        write_model_card(tmp_dir, step_dir, base_model=base_model, repo_id=repo, with_code=with_code)
    return write
