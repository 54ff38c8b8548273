"""Config: YAML + dotted overrides; unknown keys, wrong types, impossible values named."""

import os

import pytest

from dflash_ipc.config.schema import JobConfig
from dflash_ipc.config.load import dump_config, load_config
from dflash_ipc.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults_are_the_asked_topology():
    cfg = JobConfig()
    assert cfg.target.num_workers == 5 and cfg.drafter.num_workers == 3
    assert not hasattr(cfg.dispatch, "policy")  # pull always; round_robin is the bench's own baseline


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(REPO, "configs"))))
def test_shipped_configs_load(name):
    load_config(os.path.join(REPO, "configs", name))


def test_overrides_parse_types():
    cfg = load_config(None, ["optimizer.lr=3e-4", "data.bucket_boundaries=[32, 64]", "data.token_budget=64",
                             "target.devices=[cuda:0]", "drafter.devices=[cuda:1]", "model.target_layer_ids=[1,2]",
                             "run.seed=7"])
    assert cfg.optimizer.lr == pytest.approx(3e-4)
    assert cfg.data.bucket_boundaries == [32, 64]
    assert cfg.model.target_layer_ids == [1, 2] and cfg.run.seed == 7


def test_a_setting_named_off_survives_yaml_booleans(tmp_path):
    """YAML 1.1 reads off/on as booleans: a string setting that allows "off" takes it back, in an
    override and in a file; a boolean where no such setting is allowed is still refused."""
    assert load_config(None, ["drafter.compile=off"]).drafter.compile == "off"
    path = tmp_path / "c.yaml"
    path.write_text("drafter:\n  compile: off\n")
    assert load_config(str(path)).drafter.compile == "off"
    with pytest.raises(ConfigError, match=r"drafter.compile: True \(YAML reads on/off/yes/no as booleans\) not allowed"):
        load_config(None, ["drafter.compile=on"])
    with pytest.raises(ConfigError, match=r"drafter.attention: False \(YAML reads on/off/yes/no as booleans\) not"):
        load_config(None, ["drafter.attention=off"])


@pytest.mark.parametrize("override, needle", [
    ("drafter.lrr=1", "unknown key drafter.lrr"),
    ("nosection.x=1", "unknown key nosection"),
    ("optimizer.lr=abc", "optimizer.lr: expected float"),
    ("target.num_workers=two", "target.num_workers: expected int"),
    ("target.num_workers=0", "target.num_workers: must be in [1, 1024]"),
    ("data.token_budget=100", "data.token_budget"),
    ("data.bucket_boundaries=[64, 32]", "strictly increasing"),
    ("target.devices=[cpu, cpu]", "one per worker (5)"),
    ("target.devices=[gpu0]", "'gpu0' is not a device"),
    ("dispatch.policy=pull", "unknown key dispatch.policy"),
    ("target.dtype=int8", "target.dtype"),
    ("drafter.attention=sparse", "allowed: auto, flex, dense"),
    ("target.prefetch=9", "target.prefetch"),
    ("target.publish_sync=event", "target.publish_sync: 'event' not allowed"),
    ("dispatch.address=http://x", "dispatch.address"),
    ("dispatch.address=tcp://256.1.1.1:99999", "dispatch.address: 'tcp://256.1.1.1:99999': port '99999' is not"),
    ("dispatch.address=tcp://256.1.1.1:29600", "256.1.1.1 is not an IPv4 address"),
    ("dispatch.address=tcp://10.0.0.5:0", "port '0' is not a TCP port"),
    ("dispatch.address=tcp://10.0.0.5", "give tcp://HOST:PORT"),
    ("dispatch.address=tcp://:29600", "give tcp://HOST:PORT"),
    ("dispatch.address=tcp://[fe80::zz]:5", "[fe80::zz] is not an IPv6 address"),
    ("dispatch.address=tcp://bad_host!:5", "is not a host name, an IP address or *"),
    ("dispatch.address=ipc://", "an ipc:// path must be non-empty"),
    ("dispatch.address=ipc:///" + "x" * 200, "at most 107 bytes"),
    ("drafter.dtype=float64", "drafter.dtype"),
    ("noequals", "must look like section.key=value"),
    ("run.run_dir=", "run.run_dir: must name a directory"),
    ("run.seed=-7", "run.seed: must be in [0, 4294967295]"),
    ("optimizer.lr=.inf", "optimizer.lr: must be a finite number"),
    ("dispatch.heartbeat_timeout_s=.nan", "dispatch.heartbeat_timeout_s: must be a finite number"),
    ("data.token_budget=1000000000000", "data.token_budget"),
    ("data.bucket_boundaries=[64,", "override data.bucket_boundaries: not valid YAML: line 1, column"),
    ("drafter.lr=1e-3", "unknown key drafter.lr"),
    ("supervise.drafter_timeout_s=30", "unknown key supervise.drafter_timeout_s"),
    ("supervise.stop_timeout_s=-1", "supervise.stop_timeout_s: must be in [0, 86400]"),
])
def test_bad_values_are_named(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert needle in str(info.value)


def test_good_dispatcher_addresses_pass():
    for address in ("tcp://10.0.0.5:29600", "tcp://node0.cluster:29600", "tcp://*:29600", "tcp://[fe80::1]:5",
                    "tcp://localhost:65535", "ipc:///tmp/x.sock"):
        assert load_config(None, [f"dispatch.address={address}"]).dispatch.address == address


def test_publish_sync_auto_follows_gpu_sharing():
    split = load_config(None, ["target.devices=[cuda:0]", "drafter.devices=[cuda:1]"])
    assert split.target.publish_sync == "auto" and split.publish_sync_of(0) == "ipc_event"
    shared = load_config(None, ["target.num_workers=2", "target.devices=[cuda:0, cuda:1]",
                                "drafter.devices=[cuda:1]"])
    assert [shared.publish_sync_of(r) for r in (0, 1)] == ["ipc_event", "host_wait"]
    forced = load_config(None, ["target.devices=[cuda:0]", "drafter.devices=[cuda:0]",
                                "target.publish_sync=ipc_event"])
    assert forced.publish_sync_of(0) == "ipc_event"
    assert load_config(None, []).publish_sync_of(0) == "ipc_event"  # cpu: shared memory
    spelled = load_config(None, ["target.devices=[cuda:01]", "drafter.devices=[cuda:1]"])
    assert spelled.publish_sync_of(0) == "host_wait"  # one GPU, however its index is written


def test_mixing_cpu_and_cuda_is_refused():
    with pytest.raises(ConfigError, match="mixing cpu and cuda"):
        load_config(None, ["target.devices=[cuda:0]"])


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("drafter:\n  lr: [\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(str(bad))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("drafter:\n  layers: 3\n")
    with pytest.raises(ConfigError, match="unknown.yaml.*unknown key drafter.layers"):
        load_config(str(unknown))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))


def test_an_invalid_override_is_named_not_the_file_it_overrides(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("optimizer:\n  lr: 3.0e-4\n")
    with pytest.raises(ConfigError, match=r"^override -o optimiser.lr=1e-3: unknown key optimiser \(did you mean "
                                          r"optimizer\?\)"):
        load_config(str(good), ["run.seed=3", "optimiser.lr=1e-3"])
    with pytest.raises(ConfigError, match=r"^override -o optimizer.lr=-1: optimizer.lr: must be in"):
        load_config(str(good), ["optimizer.lr=-1"])
    with pytest.raises(ConfigError, match=r"^override -o optimizer.lrr=3: unknown key optimizer.lrr \(did you mean "
                                          r"optimizer.lr\?\)"):
        load_config(None, ["optimizer.lrr=3"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("optimizer:\n  lr: -1\n")  # the file itself is wrong: it is named, whatever the overrides
    with pytest.raises(ConfigError, match=r"^.*bad.yaml: optimizer.lr: must be in"):
        load_config(str(bad), ["run.seed=3"])
    assert load_config(str(bad), ["optimizer.lr=1e-3"]).optimizer.lr == pytest.approx(1e-3)  # an override may fix it


def test_bad_yaml_files_are_one_line_errors(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("data:\n  num_epochs: 2\nrun:\n  seed: 1\ndata:\n  num_epochs: 3\n")
    with pytest.raises(ConfigError, match=r"twice.yaml line 5: key 'data' given twice \(first at line 1\)"):
        load_config(str(twice))
    inner = tmp_path / "inner.yaml"
    inner.write_text("optimizer:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")
    with pytest.raises(ConfigError, match="inner.yaml line 3: key 'lr' given twice"):
        load_config(str(inner))
    for text in ("", "# only a comment\n"):
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        with pytest.raises(ConfigError, match="empty.yaml is empty"):
            load_config(str(empty))
    old = tmp_path / "old.yaml"
    old.write_text("drafter:\n  num_workers: 1\n  anchors_per_step: 64\n")
    with pytest.raises(ConfigError, match="unknown key drafter.anchors_per_step"):
        load_config(str(old))
    for error in (pytest.raises(ConfigError),):
        with error as info:
            load_config(str(tmp_path))
        assert "is a directory" in str(info.value) and "\n" not in str(info.value)



@pytest.mark.timeout(10)
def test_a_config_that_is_not_a_regular_file_is_one_error(tmp_path):
    """/dev/zero reads without end, a FIFO blocks open() until a writer comes: both refused unread."""
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link.yaml"
    link.symlink_to("/dev/zero")
    for path, kind in (("/dev/zero", "a character device"), (fifo, "a FIFO"), (link, "a character device")):
        with pytest.raises(ConfigError, match=f"the config file is {kind}.*not a regular file") as info:
            load_config(str(path))
        assert "\n" not in str(info.value)

def _alias_bomb(levels: int = 9) -> str:
    """A few hundred bytes of YAML whose value, expanded, holds 9**levels entries."""
    anchors = ["&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]"
                                                     for i in range(1, levels)]
    return "run:\n  seed: [" + ", ".join(anchors) + "]\n"


@pytest.mark.parametrize("text, needle", [
    ("data:\n  bucket_boundaries: " + "[" * 50_000 + "]" * 50_000 + "\n", "nested deeper than the parser's"),
    ("run:\n  seed: " + "9" * 5000 + "\n", "not valid YAML: Exceeds the limit (4300 digits)"),
    (_alias_bomb(), "run.seed: expected int, got list [[1, 1, 1, 1, 1, 1, 1, 1, ...], [[...], [...]"),
    ("run: !!python/object/apply:os.system ['touch owned']\n", "could not determine a constructor for the tag"),
    ("run:\n  run_dir: !!binary aGVsbG8=\n", "run.run_dir: expected str, got bytes b'hello'"),
    ("run:\n  seed: 1\n" + "#" * (2 << 20) + "\n", "is larger than 1048576 bytes"),
    ("? " + "x" * 100_000 + "\n: 1\n", "unknown key 'xxxxxxxx"),
    ("? [1]\n: 2\n", "hostile.yaml line 1: key [1] is a list; a key must be a plain value"),
    ("run:\n  {seed: 1}: 2\n", "hostile.yaml line 2: key {'seed': 1} is a dict; a key must be a plain value"),
])
def test_hostile_yaml_is_one_short_line_and_runs_nothing(tmp_path, text, needle):
    """Nesting past the recursion limit, huge integers, alias bombs (a 300-byte file naming 9^9
    list entries), Python tags and oversized files: each one short ConfigError line."""
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    message = str(info.value)
    assert needle in message and "\n" not in message and len(message) < 600, message[:300]
    assert not (tmp_path / "owned").exists() and not os.path.exists("owned")


def test_hostile_overrides_are_one_line_naming_the_key():
    for override in ("run.seed=" + "9" * 5000, "data.bucket_boundaries=" + "[" * 50_000, "run.run_dir=2020-13-45"):
        with pytest.raises(ConfigError) as info:
            load_config(None, [override])
        assert str(info.value).startswith(f"override {override.split('=')[0]}: not valid YAML")


def test_choices_are_checked_when_built_in_code():
    from dflash_ipc.config.schema import DrafterConfig, OptimizerConfig
    with pytest.raises(ConfigError, match="drafter.attention: 'sparse' not allowed; allowed: auto, flex, dense"):
        DrafterConfig(attention="sparse")
    with pytest.raises(ConfigError, match="optimizer.lr: must be a finite number"):
        OptimizerConfig(lr=float("nan"))


def test_dump_and_reload_is_identity(tmp_path):
    cfg = load_config(None, ["optimizer.lr=1e-3", "target.num_workers=2"])
    dump_config(cfg, str(tmp_path / "c.yaml"))
    assert load_config(str(tmp_path / "c.yaml")) == cfg


def test_a_gpu_this_machine_lacks_is_named():
    import torch

    from dflash_ipc.config.machine import require_device
    require_device("cpu", "target.devices")  # nothing to check
    missing = f"cuda:{torch.cuda.device_count() + 3}"
    with pytest.raises(ConfigError, match=f"target.devices: {missing}"):
        require_device(missing, "target.devices")


def test_validation_must_line_up_with_checkpoints_so_a_best_can_be_kept():
    with pytest.raises(ConfigError, match=r"validation.every_steps: 3 must divide checkpoint.every_steps=10 .* "
                                          r"e.g. validation.every_steps=1"):
        load_config(None, ["validation.every_steps=3", "checkpoint.every_steps=10"])
    assert load_config(None, ["validation.every_steps=5", "checkpoint.every_steps=10"]).validation.every_steps == 5


@pytest.mark.parametrize("address", ["tcp://host\n:5555", "tcp://node0.cluster\n:29600", "tcp://a\n.b:1"])
def test_a_host_name_ending_in_a_newline_is_refused(address):
    from dflash_ipc.config.addresses import check_address
    with pytest.raises(ConfigError, match="not a host name"):
        check_address(address, "dispatch.address")
