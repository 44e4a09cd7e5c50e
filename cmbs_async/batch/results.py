"""The results file: one JSON line per finished run, written as runs finish, signed with
the operator's key, and read back for ``--resume`` even after the batch was killed
mid-write; a line reused only when it can be trusted."""

from __future__ import annotations

import fcntl
import json
import os
import stat
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from types import TracebackType
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from .._reading import read_upto, size_text
from .._text import escape_controls
from ..audit.signing import (
    canonical,
    load_public_key,
    public_key_text,
    sign,
    verify_signature,
)
from ..audit.sqlite import SQLiteAuditStore
from ..audit.store import AuditError
from ..result import Outcome, ScenarioResult
from .jobs import BatchError, Job, shown, utf8_or_refused

__all__ = [
    "ERROR_OUTCOMES",
    "RESULT_FIELDS",
    "RESULTS_MAX_BYTES",
    "ResultLog",
    "error_record",
    "is_error",
    "judged",
    "result_record",
    "signed_payload",
    "stale_note",
    "untrusted_line",
]

#: The largest results file read back for ``--resume``.
RESULTS_MAX_BYTES = 1 << 30

#: What every result line has: a line without them is not a result line.
RESULT_FIELDS = ("key", "scenario_file", "agent", "repeat", "outcome")
_FIELD_TYPES: dict[str, type] = {name: str for name in RESULT_FIELDS} | {"repeat": int}
_TYPE_NAMES = {str: "a string", int: "a whole number"}

#: Put before a line's canonical JSON when it is signed: a results line's signature can
#: never pass for an audit record's, made with the same key.
_CONTEXT = b"cmbs batch result line\n"

#: Why a line from before is not reused, in words, by what ``ResultLog.refused`` counts.
_WHY = {
    "unsigned": "unsigned (by an older cmbs, or by hand)",
    "other key": "signed by another key",
    "broken": "changed after signing",
    "session": "whose audit session is missing or does not verify",
}

#: Outcomes that say the run could not be carried out (the agent's program or endpoint,
#: the executor, the audit trail, the runner), not how the agent did: ``--retry-errors``
#: runs them again and ``--maxfail`` counts them.
ERROR_OUTCOMES: frozenset[str] = frozenset(
    {
        Outcome.AGENT_ERROR.value,
        Outcome.EXECUTOR_ERROR.value,
        Outcome.AUDIT_ERROR.value,
        "runner_error",
    }
)


def is_error(record: dict[str, Any]) -> bool:
    """Whether a result line is a run that ended in an error outcome."""
    return record.get("outcome") in ERROR_OUTCOMES


def judged(record: dict[str, Any], expected: str | None) -> dict[str, Any]:
    """``record`` with ``expected`` (the scenario's expected posture, or None) and
    ``correct``: whether the run earned its termination with that posture (None where
    nothing is expected)."""
    correct = None
    if expected is not None:
        correct = record.get("outcome") == Outcome.TERMINATED and record.get("posture") == expected
    return record | {"expected": expected, "correct": correct}


def result_record(
    job: Job, result: ScenarioResult, started: float, finished: float
) -> dict[str, Any]:
    """The fields of ``cmbs run --json`` plus the batch's own."""
    record = {
        "key": job.key,
        "scenario_file": job.scenario_file,
        "agent": job.agent,
        "repeat": job.repeat,
        **result.summary(output=False),
        "started_at": round(started, 6),
        "finished_at": round(finished, 6),
        "executor": job.where,
        "inputs": asdict(job.what),
    }
    return judged(record, job.spec.expected)


def error_record(job: Job, reason: str, started: float, finished: float) -> dict[str, Any]:
    """A run the runner itself could not complete: recorded, never silently lost."""
    record = {
        "key": job.key,
        "scenario_file": job.scenario_file,
        "agent": job.agent,
        "repeat": job.repeat,
        "scenario_id": job.spec.id,
        "outcome": "runner_error",
        "posture": None,
        "steps": 0,
        "verdicts": {},
        "duration_s": round(finished - started, 4),
        "reason": reason,
        "trace": [],
        "started_at": round(started, 6),
        "finished_at": round(finished, 6),
        "executor": job.where,
        "inputs": asdict(job.what),
    }
    return judged(record, job.spec.expected)


def signed_payload(record: dict[str, Any]) -> bytes:
    """What a result line's ``signature`` signs: a context string, then the canonical JSON
    of the line without its ``signature``."""
    return _CONTEXT + canonical({k: v for k, v in record.items() if k != "signature"})


def untrusted_line(
    record: dict[str, Any], trusted_key: str | None, public: Ed25519PublicKey | None = None
) -> str | None:
    """Why a result line is not to be trusted (``unsigned``, ``other key``, ``broken``:
    changed after signing), or None when its signature verifies with ``trusted_key`` (a
    base64 Ed25519 public key, as ``cmbs audit key`` prints it; ``public``, if given, is
    the same key, loaded). A line that cannot even be put as the bytes a signature signs
    (a lone surrogate, ``"\\ud800"``, is valid JSON but no UTF-8) is ``broken``: no
    signature of it can be made, so none can verify."""
    signature = record.get("signature")
    if not isinstance(signature, str):
        return "unsigned"
    if trusted_key is None or record.get("signed_by") != trusted_key:
        return "other key"
    try:
        payload = signed_payload(record)
    except (ValueError, TypeError, RecursionError):  # UnicodeEncodeError is a ValueError
        return "broken"
    if not verify_signature(public or load_public_key(trusted_key), signature, payload):
        return "broken"
    return None


def _named(run: Job | dict[str, Any]) -> tuple[object, object, object]:
    """A job as a batch names it: its scenario file, agent spec and repeat."""
    if isinstance(run, Job):
        return (run.scenario_file, run.agent, run.repeat)
    return (run.get("scenario_file"), run.get("agent"), run.get("repeat"))


def stale_note(records: Iterable[dict[str, Any]], jobs: Sequence[Job]) -> str | None:
    """The note for results from before of this batch's jobs (the same scenario file,
    agent spec and repeat) that are of what the job ran then, not now; None if none."""
    now = {_named(job): job for job in jobs}
    records = list(records)
    have = {record["key"] for record in records}
    stale: dict[tuple[object, ...], list[str]] = {}
    for record in records:
        job = now.get(_named(record))
        if job is not None and job.key not in have:
            stale[_named(job)] = job.what.changed(record.get("inputs"))
    if not stale:
        return None
    changed = [
        part
        for part in ("scenario", "agent", "profile", "executor", "cmbs version")
        if any(part in parts for parts in stale.values())
    ] or ["scenario", "agent", "profile"]
    said = changed[0] if len(changed) == 1 else f"{', '.join(changed[:-1])} or {changed[-1]}"
    count = len(stale)
    return (
        f"{count} result{'s' if count != 1 else ''} from before {'are' if count != 1 else 'is'} "
        f"stale (their {said} changed): run again"
    )


class ResultLog:
    """Appends result lines durably, each signed with ``key``; knows which keys already
    have a result that can be trusted.

    On ``resume``, the file must be a results file (every line a JSON object with
    :data:`RESULT_FIELDS`; a last line cut off by a kill is dropped when the first new
    line is written), or it is refused, untouched. A line from before is reused only
    when its ``signature`` verifies with ``key``; and when it names the audit database
    this batch records into (``audit_db``), only when its session is there and verifies
    with ``key`` too. ``untrusted`` holds the others, with why (:meth:`refused_note`);
    their jobs run again. Without ``key`` nothing is signed, and nothing read back is reused.

    With ``retry_errors``, a key whose last trusted result is an error outcome (see
    :data:`ERROR_OUTCOMES`) counts as not done (``retrying`` lists those results); its new
    result is appended, and the later line of a key is the one that counts.

    The log holds an exclusive lock (``flock``) on the file from before it is read until
    :meth:`close`: a second batch on the same file is refused ("in use by another cmbs
    batch"), so two batches never drop each other's lines. A file this log made is
    removed again at :meth:`close` if no result was written to it (a batch that failed
    to start leaves none, which a retry would otherwise refuse).

    A result that cannot be written as it is (:meth:`keep`: a string no UTF-8 can hold,
    say) is written as a ``runner_error`` line in its stead where that can be; ``replaced``
    and ``lost`` say, in one line each, what was not written as it was.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        resume: bool,
        retry_errors: bool = False,
        key: Ed25519PrivateKey | None = None,
        audit_db: str | Path | None = None,
    ) -> None:
        self.path = Path(path)
        self._key = key
        self._public = public_key_text(key) if key is not None else None
        self.audit_db = str(Path(audit_db).resolve()) if audit_db is not None else None
        if self.audit_db is not None:  # every result line with a session names it
            utf8_or_refused(self.audit_db, "the audit database")
        self.previous: list[dict[str, Any]] = []
        self.untrusted: list[tuple[str, dict[str, Any]]] = []
        self.written: list[dict[str, Any]] = []
        self.replaced: list[str] = []  # why results were written as runner_error lines
        self.lost: list[str] = []  # why results could not be written at all
        self._cut: int | None = None  # where a cut-off last line begins
        self._tail = b""  # that cut-off line, as read
        self._size = 0  # the file's size when it was read
        self._started = False  # whether the first line was written
        self._made: list[Path] = []  # the file and the folders this log made, if it did
        self._fd: int | None = self._locked(resume)
        try:
            if resume and not self._made:
                self.previous = self._trusted(self._read_back())
        except BaseException:
            self.close()
            raise
        latest = {record["key"]: record for record in self.previous}
        self.retrying = [r for r in latest.values() if retry_errors and is_error(r)]
        self.done = set(latest) - {record["key"] for record in self.retrying}

    def _locked(self, resume: bool) -> int:
        """The file, opened for appending and locked for this log alone (made, with its
        folders, if there is none yet), or why not, in one line; nothing of it changed."""
        name = shown(str(self.path))
        try:
            mode: int | None = os.stat(self.path).st_mode
        except FileNotFoundError:
            mode = None
        except OSError as exc:
            raise BatchError(f"{name}: cannot open: {exc.strerror or exc}") from None
        if mode is not None and not resume:
            raise BatchError(
                f"{name} is in use by another cmbs batch"
                if _in_use(self.path)
                else f"{name} exists: pass --resume to continue it, or another --out"
            )
        if mode is not None and not stat.S_ISREG(mode):  # /dev/zero, a FIFO: never opened
            raise BatchError(f"{name} is not a results file (not a regular file)")
        flags = os.O_RDWR | os.O_APPEND | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = None
            if mode is None:
                folders = [p for p in reversed(self.path.parents) if not p.exists()]
                self.path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o666)
                    self._made = [self.path, *reversed(folders)]
                except FileExistsError:  # made meanwhile: locked by its maker, or ours
                    if not resume:
                        raise BatchError(
                            f"{name} exists: pass --resume to continue it, or another --out"
                        ) from None
            if fd is None:
                fd = os.open(self.path, flags)
        except OSError as exc:
            raise BatchError(f"{name}: cannot open: {exc.strerror or exc}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since it was looked at
                raise BatchError(f"{name} is not a results file (not a regular file)")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # the batch holding it owns the file, made here or not
            os.close(fd)
            self._made = []
            raise BatchError(f"{name} is in use by another cmbs batch") from None
        except BaseException as exc:
            os.close(fd)
            self._unmake()
            if isinstance(exc, OSError):
                raise BatchError(f"{name}: cannot lock: {exc.strerror or exc}") from None
            raise
        return fd

    def _read_back(self) -> list[dict[str, Any]]:
        """Every line, once the whole file is known to be a results file: nothing of it
        is changed before."""
        data = self._contents()
        self._size = len(data)
        end = data.rfind(b"\n") + 1
        try:
            text = data[:end].decode("utf-8")
        except UnicodeDecodeError:
            raise self._refused("not UTF-8 text") from None
        lines = text.split("\n")[:-1]
        records = [self._line(line, number) for number, line in enumerate(lines, 1)]
        tail = data[end:]
        if tail:  # no newline at the end: a last line whole, or cut off by a kill
            number = len(lines) + 1
            try:
                json.loads(tail.decode("utf-8"))
            except (ValueError, RecursionError):  # unfinished (or not UTF-8 where cut)
                if not tail.startswith(b'{"key": "'):  # not how a result line begins
                    raise self._refused("not JSON", number) from None
                self._cut, self._tail = end, tail
            else:  # whole: it must be a result line like any other (ended when written to)
                records.append(self._line(tail.decode("utf-8"), number))
        return [record for record in records if record is not None]

    def _contents(self) -> bytes:
        """What the locked file holds, up to :data:`RESULTS_MAX_BYTES`."""
        assert self._fd is not None
        try:
            data = read_upto(self._fd, RESULTS_MAX_BYTES + 1, offset=0)
        except OSError as exc:
            raise BatchError(f"{shown(str(self.path))}: cannot read: {exc.strerror}") from None
        if len(data) > RESULTS_MAX_BYTES:
            raise BatchError(
                f"{shown(str(self.path))}: larger than {size_text(RESULTS_MAX_BYTES)} "
                "(the cap for a results file)"
            )
        return data

    def _line(self, line: str, number: int) -> dict[str, Any] | None:
        """The result of one line (None for a blank one), or why the file is refused."""
        if not line.strip():
            return None
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            raise self._refused("not JSON", number) from None
        if not isinstance(record, dict):
            raise self._refused("not a JSON object", number)
        missing = [name for name in RESULT_FIELDS if name not in record]
        if missing:
            raise self._refused(f"no {', '.join(missing)}", number)
        for name, kind in _FIELD_TYPES.items():
            if not isinstance(record[name], kind) or isinstance(record[name], bool):
                raise self._refused(f"its {name} is not {_TYPE_NAMES[kind]}", number)
        return record

    def _refused(self, why: str, number: int | None = None) -> BatchError:
        """The file is not a results file: said in one line, and it is left as it is."""
        name = shown(str(self.path))
        where = f"{name}:{number} is not a result line" if number else name
        return BatchError(f"{where} ({why}): not a results file, left as it is")

    def _trusted(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The lines signed with this log's key (and whose session verifies, where the
        audit database is this batch's); ``untrusted`` holds the others, with why."""
        public = self._key.public_key() if self._key is not None else None
        signed = []
        for record in records:
            why = untrusted_line(record, self._public, public)
            if why is None:
                signed.append(record)
            else:
                self.untrusted.append((why, record))
        audited = {
            str(r.get("session_id"))
            for r in signed
            if self.audit_db is not None and r.get("audit_db") == self.audit_db
        }
        broken = self._broken_sessions(audited) if audited else set()
        kept = []
        for record in signed:
            if record.get("audit_db") == self.audit_db and str(record.get("session_id")) in broken:
                self.untrusted.append(("session", record))
            else:
                kept.append(record)
        return kept

    @property
    def refused(self) -> Counter[str]:
        """How many lines from before are not reused, by why: ``unsigned``, ``other key``
        (signed with another), ``broken`` (changed after signing), ``session`` (its audit
        session missing or not verifying)."""
        return Counter(reason for reason, _ in self.untrusted)

    def _broken_sessions(self, sessions: set[str]) -> set[str]:
        """Those of ``sessions`` the audit database does not hold, or holds other than as
        this log's key signed them."""
        assert self.audit_db is not None
        try:
            store = SQLiteAuditStore(self.audit_db, read_only=True)
        except AuditError:  # gone, or not a database: nothing in it can be checked
            return sessions
        try:
            found = store.sessions_problems(sessions, trusted_key=self._public)
            return {session for session, problems in found.items() if problems}
        except AuditError:
            return sessions
        finally:
            store.close()

    def refused_note(self, jobs: Sequence[Job] = ()) -> str | None:
        """One line saying how many lines from before are not reused, why, and how many of
        ``jobs`` they stand for (by key, or by scenario file, agent and repeat) run again
        for want of a trusted result; None if every line is reused."""
        count = len(self.untrusted)
        if not count:
            return None
        why = ", ".join(f"{n} {_WHY[reason]}" for reason, n in sorted(self.refused.items()))
        named = {_named(record) for _, record in self.untrusted}
        keys = {record["key"] for _, record in self.untrusted}
        again = sum(
            1
            for job in jobs
            if job.key not in self.done and (job.key in keys or _named(job) in named)
        )
        many = count != 1
        return escape_controls(
            f"{count} result line{'s' if many else ''} of {shown(str(self.path))} cannot be "
            "trusted and "
            f"{'are' if many else 'is'} not reused ({why})"
            + (": 1 run they stand for runs again" if again == 1 else "")
            + (f": {again} runs they stand for run again" if again > 1 else "")
        )

    def append(self, record: dict[str, Any]) -> None:
        """Sign ``record`` (it gains ``audit_db`` where it has a session, ``signed_by``
        and ``signature``) and append it as one line, fsynced; or, when it cannot be
        written, a :class:`BatchError` saying why in one line, with the file and
        ``record`` as they were."""
        if self._fd is None:
            raise BatchError(f"{shown(str(self.path))}: the results file is closed")
        line = dict(record)
        try:
            if self._public is not None:
                line["audit_db"] = self.audit_db if line.get("session_id") else None
                line["signed_by"] = self._public
                line.pop("signature", None)
                body = json.loads(json.dumps(line))  # signed as it will be read back
                assert self._key is not None
                line["signature"] = sign(self._key, signed_payload(body))
            data = (json.dumps(line) + "\n").encode("utf-8")  # ASCII: escapes, all of it
        except (ValueError, TypeError, RecursionError) as exc:
            raise BatchError(
                escape_controls(f"result {record.get('key')}: cannot be written: {exc}")
            ) from None
        if not self._started:
            self._start()
        self._write(data)
        record.pop("signature", None)
        record.update(line)
        self.done.add(record["key"])
        self.written.append(record)

    def keep(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """:meth:`append` ``record``; if it cannot be written as it is, a ``runner_error``
        line in its stead (what can be said of the run, every string made UTF-8), noted
        in ``replaced``; if not even that can be, noted in ``lost``. The record written,
        or None."""
        try:
            self.append(record)
            return record
        except BatchError as exc:
            why = str(exc)
        stead = _in_its_stead(record, why)
        try:
            self.append(stead)
        except BatchError as exc:
            self.lost.append(str(exc))
            return None
        self.replaced.append(why)
        return stead

    def _start(self) -> None:
        """Before the first new line: drop a cut-off last line, if the file is as it was
        read (a line a writer not holding the lock added since is never dropped); end
        whatever last line has no newline."""
        assert self._fd is not None
        try:
            size = os.fstat(self._fd).st_size
            if (
                self._cut is not None
                and size == self._size
                and os.pread(self._fd, len(self._tail), self._cut) == self._tail
            ):
                os.ftruncate(self._fd, self._cut)
                size = self._cut
            if size and os.pread(self._fd, 1, size - 1) != b"\n":
                os.write(self._fd, b"\n")
        except OSError as exc:
            raise BatchError(
                f"{shown(str(self.path))}: cannot write a result: {exc.strerror or exc}"
            ) from None
        self._started = True

    def _write(self, data: bytes) -> None:
        """``data`` appended whole and fsynced, or taken back (nothing half written)."""
        assert self._fd is not None
        before: int | None = None
        try:
            before = os.fstat(self._fd).st_size
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
        except OSError as exc:
            if before is not None:
                try:
                    os.ftruncate(self._fd, before)
                except OSError:
                    pass
            raise BatchError(
                f"{shown(str(self.path))}: cannot write a result: {exc.strerror or exc}"
            ) from None

    @property
    def records(self) -> list[dict[str, Any]]:
        """The result of every run in the file that can be trusted, from before (when
        resuming) and from this run: the last line of each key, where a run was retried."""
        latest = {record["key"]: record for record in self.previous + self.written}
        return list(latest.values())

    def close(self) -> None:
        """Let the file go (its lock with it); a file this log made and wrote nothing to
        is removed, and the folders it made for it."""
        if self._fd is None:
            return
        if not self.written:
            self._unmake()
        os.close(self._fd)
        self._fd = None

    def _unmake(self) -> None:
        """Remove what this log made: the file, if it is still empty, and its folders."""
        for made in self._made:
            try:
                if made == self.path:
                    if os.stat(made).st_size:
                        return
                    made.unlink()
                else:
                    made.rmdir()  # only when empty
            except OSError:
                return
        self._made = []

    def __enter__(self) -> ResultLog:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _in_use(path: Path) -> bool:
    """Whether another batch holds ``path``'s lock (looked at, never taken)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # the lock, if taken, with it
    return False


def _in_its_stead(record: dict[str, Any], why: str) -> dict[str, Any]:
    """The ``runner_error`` line for a result that could not be written as it is: the
    fields that name the run, its times and inputs, and why, every string made UTF-8."""
    named = ("key", "scenario_file", "agent", "repeat", "scenario_id", "executor", "inputs")
    kept = {name: record.get(name) for name in named}
    started, finished = record.get("started_at"), record.get("finished_at")
    kept |= {
        "outcome": "runner_error",
        "posture": None,
        "steps": 0,
        "verdicts": {},
        "duration_s": record.get("duration_s"),
        "reason": f"the run ended {record.get('outcome')}, but its result could not be "
        f"written as it was: {why}",
        "trace": [],
        "started_at": started,
        "finished_at": finished,
    }
    expected = record.get("expected")
    made = _encodable(judged(kept, expected if isinstance(expected, str) else None))
    assert isinstance(made, dict)
    return made


def _encodable(value: object) -> object:
    """``value`` with every string UTF-8 text (a file name's bytes that are not as
    ``\\xff``, a lone surrogate as ``\\ud800``) and anything that is no JSON as text."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            try:
                raw = value.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                raw = value.encode("utf-8", "backslashreplace")
            return raw.decode("utf-8", "backslashreplace")
    if isinstance(value, dict):
        return {str(_encodable(str(k))): _encodable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encodable(item) for item in value]
    if value is None or isinstance(value, bool | int | float):
        return value
    return _encodable(str(value))
