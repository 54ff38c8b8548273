"""Typed errors. Each docstring says what went wrong and how a caller recovers.

Every failure that crosses a module boundary is one of these, so the supervisor and the
workers can act on the kind of failure (retry, restart a worker, stop the job) instead of
parsing messages.
"""


EXIT_CONFIG_ERROR = 78  # sysexits' EX_CONFIG: a process stopped on a ConfigError (never restarted)
EXIT_ERROR = 2          # any other DFlashError


class DFlashError(Exception):
    """Base of every error raised on purpose by dflash_ipc."""


class ConfigError(DFlashError, ValueError):
    """The configuration is invalid. The message names the key and the allowed values.

    Recovery: fix the YAML file or the `-o key=value` override and start again; nothing
    has been started or written yet.
    """


class DataError(DFlashError, ValueError):
    """Input data is malformed or does not match the job (file, line and field named).

    Recovery: fix or re-prepare the data; prepared output already on disk is untouched.
    """


class ProtocolError(DFlashError):
    """A wire message could not be decoded or is not valid for its kind.

    Recovery: the receiver logs and drops the message and keeps serving; the sender is
    buggy or hostile. Never fatal for the dispatcher.
    """


class UnregisteredSender(ProtocolError):
    """A message came from a sender the dispatcher has no seat for.

    Recovery: the dispatcher answers `Unregistered`; a worker whose dispatcher restarted
    registers again, one the dispatcher dropped (hung, replaced) exits.
    """


class TransportError(DFlashError):
    """A hidden-state slot could not be created, opened, written or read.

    Recovery: fatal for the worker that sees it; the supervisor restarts the worker and
    the dispatcher returns the affected batches to pending.
    """


class ProducerGoneError(TransportError):
    """The target that owns a slot pool died while a consumer was using it.

    Recovery: the consumer drops the batch (it is not consumed); the dispatcher requeues
    it when it learns that the target died.
    """


class WorkerDeadError(DFlashError):
    """A worker process died or stopped answering heartbeats.

    Recovery: the supervisor applies its restart policy; after too many restarts in the
    window the job stops with this error.
    """


class BatchKeepsGettingLost(DFlashError):
    """The drafters reported one batch lost (its hidden states could not be copied from its
    target) `dispatch.max_batch_losses` times: something systematic, not a dead target.

    Recovery: none inside the dispatcher, which exits with this error (the ledger saved); the
    supervisor's restart policy applies. The drafters' logs say why each copy failed.
    """


class DispatcherRestarted(WorkerDeadError):
    """The dispatcher this worker registered with was replaced by a new process.

    Recovery: a target registers again with its pool (every slot is free: the new
    dispatcher restored its ledger with every uncommitted batch pending); a drafter exits
    and is restarted with its group.
    """


class DamagedCheckpointError(DataError):
    """A checkpoint's files are missing, truncated or differ from its manifest's checksums.

    Recovery: resume falls back to the newest intact committed checkpoint (the ledger
    returns the batches committed after it to pending); an export names another step.
    """


class MissingExtraError(DFlashError):
    """An optional dependency of the command is not installed; the message names the pip
    extra that brings it (e.g. `pip install 'dflash-ipc[report]'`).

    Recovery: install it and run the command again; nothing has been written.
    """
