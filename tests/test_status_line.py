"""The supervisor's status line and the epoch progress bar with ETA, on constructed statuses;
StatusLine stepped through a scripted job: monotone progress, a final pair that is final."""

import pytest

from dflash_ipc.obs.progress import format_duration
from dflash_ipc.obs.status_line import StatusLine, estimate_eta_s, format_progress, format_status
from dflash_ipc.wire import status as st
from statuses import drafter, make_status, target


def _status(epochs, *, tok_rate=0.0, trained=0, committed_tokens=0, consumed_tokens=0, consumed=0,
            total_tokens=0, finished=False):
    return make_status(epochs, tok_rate=tok_rate, trained=trained, committed_tokens=committed_tokens,
                       consumed_tokens=consumed_tokens, consumed=consumed, total_tokens=total_tokens,
                       finished=finished)


def test_start_of_job_has_an_empty_bar_and_no_eta():
    line = format_progress(_status([(10, 0), (10, 0)], total_tokens=2000), width=10)
    assert line == "epoch 1/2 [..........]   0% of 10 batches trained  job 0%  ETA --"


def test_mid_second_of_three_epochs():
    # 100 tokens a batch: epochs of 10 000, 10 000 and 9 000 tokens; 14 500 trained fill the
    # first and 45 % of the second (half the job); 14 500 left at 60/s: 241 s
    status = _status([(100, 100), (100, 41), (90, 0)], tok_rate=60.0, trained=14_500,
                     committed_tokens=14_100, consumed_tokens=14_900, consumed=8, total_tokens=29_000)
    assert estimate_eta_s(status) == pytest.approx((29_000 - 14_500) / 60.0)
    line = format_progress(status, width=20)
    assert line == "epoch 2/3 [#########...........]  45% of 100 batches trained  job 50%  ETA 4m01s"


def test_eta_counts_trained_tokens_ahead_of_commits():
    status = _status([(10, 2)], tok_rate=50.0, trained=600, committed_tokens=200, consumed_tokens=700,
                     consumed=5)
    # 100 tokens a batch -> 1000 planned, 600 trained -> 400 left at 50/s
    assert estimate_eta_s(status) == pytest.approx(8.0)


def test_eta_before_any_commit_uses_consumed_batches_then_total_when_present():
    status = _status([(10, 0)], tok_rate=10.0, trained=0, consumed_tokens=300, consumed=3)
    assert estimate_eta_s(status) == pytest.approx(100.0)  # 10 batches x 100 tokens, nothing trained
    status.tokens.total = 5_000
    assert estimate_eta_s(status) == pytest.approx(500.0)


@pytest.mark.parametrize("rate", [0.0, -1.0, float("nan")])
def test_zero_or_unknown_rate_prints_no_eta(rate):
    status = _status([(10, 5), (10, 0)], tok_rate=rate, trained=500, committed_tokens=500)
    assert estimate_eta_s(status) is None
    assert format_progress(status).endswith("ETA --")


def test_done():
    status = _status([(10, 10), (10, 10), (5, 5)], tok_rate=0.0, trained=2500, committed_tokens=2500,
                     total_tokens=2500, finished=True)
    assert format_progress(status, width=8) == "epoch 3/3 [########] 100% of 5 batches trained  job 100%  ETA done"


def test_without_epochs_falls_back_to_the_whole_job():
    status = _status([(8, 2)], tok_rate=100.0, committed_tokens=200, trained=300, total_tokens=800)
    status.epochs = []
    assert format_progress(status, width=8) == "[###.....]  37% of 8 batches trained  ETA 5s"


def test_a_status_without_planned_tokens_shows_committed_batches():
    """A status of a dispatcher that sends no planned tokens (nor per epoch): what was committed."""
    status = _status([(10, 4), (10, 0)], trained=600, committed_tokens=400)
    assert format_progress(status, width=10) == "epoch 1/2 [####......]  40% of 10 batches committed  job 20%  ETA --"


def test_bar_width_is_constant():
    for trained in range(0, 800, 50):
        line = format_progress(_status([(7, 0)], trained=trained, total_tokens=700), width=13)
        bar = line[line.index("[") + 1:line.index("]")]
        assert len(bar) == 13 and set(bar) <= {"#", "."}


@pytest.mark.parametrize("seconds,text", [(0, "0s"), (59.9, "59s"), (192, "3m12s"), (3600 + 125, "1h02m"),
                                          (2 * 86400 + 3 * 3600 + 59, "2d03h"), (-5, "0s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_format_status():
    status = _status([(20, 12), (10, 6)], tok_rate=4980.0)
    status.rates.tgt_rate, status.rates.dft_rate = 5210.0, 5050.0
    b = status.batches
    b.pending, b.leased, b.produced, b.consumed = 8, 5, 2, 3
    status.targets = {"0": target(free_slots=6), "1": target(free_slots=8)}
    status.drafters = {"0": drafter(metrics={"step": 12.0, "loss": 4.812}), "1": drafter()}
    assert format_status(status) == (
        "[   42s]  60% 18/30 batches committed | tgt_rate 5,210 dft_rate 5,050 tok_rate 4,980 tok/s | "
        "step 12 loss 4.812 | pending 8 leased 5 produced 2 consumed 3 | free slots 14")
    status.average_rates = st.Rates(tgt_rate=1.0, dft_rate=2.0, tok_rate=3.0)
    assert format_status(status, final=True).startswith(
        "done, averages: [   42s]  60% 18/30 batches committed | tgt_rate 1 ")


def test_the_bar_moves_between_commits():
    # One checkpoint at the end: 0 batches committed, but 600 of 1000 tokens through a step.
    status = _status([(10, 0)], tok_rate=50.0, trained=600, consumed_tokens=700, consumed=7, total_tokens=1000)
    assert format_progress(status, width=10) == "epoch 1/1 [######....]  60% of 10 batches trained  ETA 8s"


def test_an_epoch_trained_but_not_committed_is_not_shown_at_0():
    """Seen on a real job (14 epochs of 48 batches, a checkpoint every ~20 s): epoch 8 at 0 %
    and `job 50%` while 53 % of the job's tokens were trained. The bar, `job` and the trained
    share are one figure now."""
    status = _status([(48, 48)] * 7 + [(48, 0)] * 7, tok_rate=32_633.0, trained=356_000,
                     committed_tokens=336_000, consumed=36, total_tokens=672_000)
    assert format_progress(status, width=10) == (
        "epoch 8/14 [####......]  41% of 48 batches trained  job 52%  ETA 9s")


def test_status_line_percent_is_floored():
    status = _status([(200, 199)])
    assert format_status(status).startswith("[   42s]  99% 199/200 batches committed")  # 99.5 % is not done


def test_stepped_job_progress_never_goes_back_and_ends_final():
    """A job of one epoch: trained 90 %, then a drafter group restarted from its last
    checkpoint (the tokens trained since are trained again), and the last live bar short of
    the end: only the closing pair says done."""
    line = StatusLine(width=10)
    script = [
        # (committed batches of 10, trained tokens of 1000, committed tokens)
        (0, 300, 0), (0, 600, 0), (8, 900, 800), (8, 800, 800), (8, 850, 800), (8, 990, 800),
    ]
    shown = []
    for committed, trained, committed_tokens in script:
        status = _status([(10, committed)], tok_rate=50.0, trained=trained, committed_tokens=committed_tokens,
                         total_tokens=1000, consumed=10 - committed)
        status_line, bar = line.lines(status)
        assert status_line == format_status(status)
        shown.append(bar)
    shares = [int(bar.split("] ")[1].split("%")[0]) for bar in shown]
    assert shares == [30, 60, 90, 90, 90, 99]
    # the share holds; the ETA counts what is left now: (1000 - 850) / 50 = 3 s
    assert shown[4] == "epoch 1/1 [#########.]  90% of 10 batches trained  ETA 3s"
    final = _status([(10, 10)], trained=1000, committed_tokens=1000, total_tokens=1000, finished=True)
    final.average_rates = st.Rates(tgt_rate=30.0, dft_rate=25.0, tok_rate=20.0)
    done, bar = line.final_lines(final)
    assert done.startswith("done, averages: [   42s] 100% 10/10 batches committed | tgt_rate 30 dft_rate 25 "
                           "tok_rate 20 ")
    assert bar == "epoch 1/1 [##########] 100% of 10 batches trained  ETA done"


def test_a_resumed_job_shows_its_committed_work_as_trained_and_never_goes_back():
    """A rerun of a job (a new supervisor, a dispatcher on the saved ledger): 2400 of 3000
    tokens committed count as trained from the first line; then a rollback to an older
    checkpoint undoes 600 of them, and the shares hold until the retrained work passes them."""
    line = StatusLine(width=10)
    script = [
        # (committed batches per epoch of 10, trained tokens, committed tokens), 100 a batch
        ([(10, 10), (10, 10), (10, 4)], 2400, 2400),
        ([(10, 10), (10, 10), (10, 4)], 2600, 2400),
        ([(10, 10), (10, 8), (10, 0)], 1800, 1800),  # the group resumed from an older checkpoint
        ([(10, 10), (10, 10), (10, 4)], 2800, 2400),
    ]
    shown = []
    for epochs, trained, committed_tokens in script:
        status = _status(epochs, tok_rate=100.0, trained=trained, committed_tokens=committed_tokens,
                         total_tokens=3000)
        shown.append(line.lines(status)[1])
    assert shown == [
        "epoch 3/3 [####......]  40% of 10 batches trained  job 80%  ETA 6s",
        "epoch 3/3 [######....]  60% of 10 batches trained  job 86%  ETA 4s",
        "epoch 3/3 [######....]  60% of 10 batches trained  job 86%  ETA 12s",
        "epoch 3/3 [########..]  80% of 10 batches trained  job 93%  ETA 2s",
    ]


def test_status_of_an_ended_job_is_its_final_status(tmp_path, monkeypatch):
    """`dflash-ipc status` of a job whose dispatcher has ended prints the final status it wrote,
    says so, and still fails where there is none."""
    import json

    from dflash_ipc.errors import WorkerDeadError
    from dflash_ipc.run.files import RunFiles
    from dflash_ipc.supervise import status_query

    def no_dispatcher(run_dir):
        raise WorkerDeadError("dispatcher silent for 3.0s")
    monkeypatch.setattr(status_query, "fetch_status", no_dispatcher)
    files = RunFiles(str(tmp_path))
    open(files.job_config, "w").close()
    with pytest.raises(WorkerDeadError, match="silent"):
        status_query.query_status(str(tmp_path))
    status = _status([(4, 4)], finished=True)
    status.average_rates = st.Rates(tgt_rate=10.0, dft_rate=9.0, tok_rate=8.0)
    status.targets = {"0": target(free_slots=2, batches=4, tokens=512, heartbeat_age_s=0.5)}
    # A NaN loss is written as null (strict JSON): shown as nan, not a crash.
    status.drafters = {"0": drafter(metrics={"step": 7.0, "loss": float("nan")}, batches=4, heartbeat_age_s=0.2)}
    with open(files.final_status, "w") as f:
        json.dump(status.to_json(), f)
    lines = status_query.query_status(str(tmp_path)).splitlines()
    assert lines[0].startswith("no dispatcher answers (dispatcher silent for 3.0s); the job's final status")
    assert lines[1].startswith("done, averages: [   42s] 100% 4/4 batches committed | tgt_rate 10 ")
    assert lines[2].startswith("  target/0: 4 batches 512 tokens")
    assert lines[3] == "  drafter/0: step 7 loss nan, 4 batches, heartbeat 0.2s ago"



@pytest.mark.parametrize("damage, needle", [
    (lambda s: s.pop("targets"), "targets"),
    (lambda s: s["targets"]["0"].pop("free_slots"), "free_slots"),
    (lambda s: s["targets"]["0"].update(tokens="many"), "tokens"),
    (lambda s: s["drafters"].update({"1": 5}), "drafters"),
    (lambda s: s["drafters"]["0"].update(metrics=[1]), "metrics"),
    (lambda s: s["average_rates"].pop("tgt_rate"), "tgt_rate"),
    (lambda s: s.update(num_batches=True), "num_batches"),
    (lambda s: s.update(batches={"committed": "4"}), "batches"),
    (lambda s: s.clear(), "missing"),
])
def test_a_damaged_final_status_is_one_error_naming_the_file_and_entry(tmp_path, monkeypatch, damage, needle):
    """Wrong-typed or missing entries of final_status.json: one DataError naming the file and the
    entry (it was a KeyError traceback)."""
    import json

    from dflash_ipc.errors import DataError, WorkerDeadError
    from dflash_ipc.run.files import RunFiles
    from dflash_ipc.supervise import status_query

    def no_dispatcher(run_dir):
        raise WorkerDeadError("dispatcher silent for 3.0s")
    monkeypatch.setattr(status_query, "fetch_status", no_dispatcher)
    files = RunFiles(str(tmp_path))
    open(files.job_config, "w").close()
    status = _status([(4, 4)], finished=True)
    status.average_rates = st.Rates(tgt_rate=10.0, dft_rate=9.0, tok_rate=8.0)
    status.targets = {"0": target(free_slots=2, batches=4, tokens=512, heartbeat_age_s=0.5)}
    status.drafters = {"0": drafter(metrics={"step": 7.0}, batches=4, heartbeat_age_s=0.2)}
    plain = json.loads(json.dumps(status.to_json()))
    damage(plain)
    with open(files.final_status, "w") as f:
        json.dump(plain, f)
    with pytest.raises(DataError) as info:
        status_query.query_status(str(tmp_path))
    message = str(info.value)
    assert files.final_status in message and needle in message and "\n" not in message, message
    assert "restore the file from a backup, or remove it" in message


def test_status_json_is_strict_json_whatever_the_status_holds(tmp_path, monkeypatch):
    """`status --json` prints JSON every parser reads: a NaN or inf anywhere becomes null."""
    import json

    from dflash_ipc.run.files import RunFiles
    from dflash_ipc.supervise import status_query
    open(RunFiles(str(tmp_path)).job_config, "w").close()
    status = _status([(4, 1)], tok_rate=float("nan"))
    status.targets = {"0": target(metrics={"loss": float("inf")})}
    monkeypatch.setattr(status_query, "fetch_status", lambda run_dir: status)
    text = status_query.query_status(str(tmp_path), as_json=True)
    assert "NaN" not in text and "Infinity" not in text
    got = json.loads(text)
    assert got["rates"]["tok_rate"] is None and got["targets"]["0"]["metrics"] == {"loss": None}
    assert got["uncommitted_checkpoints"] == [] and got["batches"]["committed"] == 1


@pytest.mark.parametrize("change, needle", [
    (lambda d: d.pop("batches"), r"missing \['batches'\]"),
    (lambda d: d["tokens"].update(committed="12"), r"status.tokens.committed: str '12' is not int"),
    (lambda d: d["targets"].update({"0": {"pid": 1}}), r"status.targets\['0'\]: unknown fields \[\], missing"),
    (lambda d: d.update(epochs={}), r"status.epochs: dict is not a list"),
    (lambda d: d.update(renamed=1), r"unknown fields \['renamed'\]"),
])
def test_a_final_status_of_another_shape_is_one_clear_error(tmp_path, change, needle):
    """A final_status.json with a field missing, renamed or of another type: one DataError naming
    the file and the field, never a KeyError where it is read."""
    import json

    from dflash_ipc.errors import DataError
    data = _status([(4, 4)], finished=True).to_json()
    change(data)
    path = tmp_path / "final_status.json"
    path.write_text(json.dumps(data))
    with pytest.raises(DataError, match=needle) as info:
        st.read_status_file(str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)
