"""The decision record on disk: one versioned JSON file per device, written atomically under a lock.

Layout of the state directory (created 0700; refused when other users can write it)::

    probe.lock                 filelock: one probe or record write at a time on this host
    probe-<device key>.json    the record of one device (``cpu`` on a machine without one)
    events-<device key>.jsonl  runtime events the patcher adds, one JSON object a line

Records are JSON only (never pickle). A write goes to a temporary file in the same directory and
``os.replace`` puts it in place, so a reader, or a process killed mid-write, sees the old record
or the new one, never part of one.
"""

import hashlib
import json
import logging
import os
import re
import tempfile
import time

import filelock

from . import settings

FORMAT = "biv100-patch-probe"
SCHEMA_VERSION = 1
BACKENDS = ("triton", "torch", "off")
LOCK_NAME = "probe.lock"
RECORD_PREFIX = "probe-"
EVENTS_PREFIX = "events-"
MAX_RECORD_BYTES = 4 << 20
MAX_EVENTS_BYTES = 1 << 20
EVENTS_SHOWN = 50
REQUIRED_KEYS = ("fingerprint", "device", "versions", "checks", "decision")

log = logging.getLogger("biv100_patch.probe")
_logged = set()


def log_once(level, message):
    """Log ``message`` once per process: a serving process must not be flooded with one fault."""
    if message not in _logged:
        _logged.add(message)
        log.log(level, "%s", message)


def canonical_json(value):
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def fingerprint_id(fingerprint):
    """A short stable hash of a fingerprint dict."""
    return hashlib.sha256(canonical_json(fingerprint).encode()).hexdigest()[:16]


def device_key(device):
    """File-name key of a device: ``cpu``, or a hash of its uuid (else name and index)."""
    if not device or device.get("index") is None:
        return "cpu"
    identity = device.get("uuid") or f"{device.get('name')}#{device.get('index')}"
    return "gpu-" + hashlib.sha256(str(identity).encode()).hexdigest()[:16]


class Store:
    """The state directory; every method reports trouble as a problem sentence instead of raising."""

    def __init__(self, directory=None):
        self.directory = directory if directory is not None else settings.state_dir()

    def record_path(self, key):
        return os.path.join(self.directory, f"{RECORD_PREFIX}{key}.json")

    def events_path(self, key):
        return os.path.join(self.directory, f"{EVENTS_PREFIX}{key}.jsonl")

    def trust_problem(self):
        """Why records here must not be trusted (None when the directory is private to us or absent)."""
        try:
            status = os.stat(self.directory)
        except (FileNotFoundError, NotADirectoryError):
            return None  # absent: prepare() says whether it can be made
        except OSError as error:
            return f"state directory {self.directory} cannot be read: {error.strerror or error}"
        if not os.path.isdir(self.directory):
            return f"state directory {self.directory} is not a directory"
        if status.st_uid not in (os.geteuid(), 0):  # root's, e.g. a record an administrator provided
            return f"state directory {self.directory} belongs to uid {status.st_uid}, not to this user"
        if status.st_mode & 0o022:
            return (f"state directory {self.directory} is writable by other users "
                    f"(mode {status.st_mode & 0o777:o}); use a private one (0700)")
        return None

    def prepare(self):
        """Create the directory 0700 if needed; the problem sentence, or None when records can be written."""
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=False)
            os.chmod(self.directory, 0o700)  # exact mode, whatever the umask
        except FileExistsError:
            pass
        except OSError as error:
            return f"state directory {self.directory} cannot be created: {error.strerror or error}"
        problem = self.trust_problem()
        if problem:
            return problem
        if not os.access(self.directory, os.W_OK):
            return f"state directory {self.directory} is read-only"
        return None

    def lock(self, timeout):
        return filelock.FileLock(os.path.join(self.directory, LOCK_NAME), timeout=timeout)

    def read(self, key=None, path=None):
        """``(record, None)``, or ``(None, why not)``; ``(None, None)`` when there is no record yet."""
        path = path or self.record_path(key)
        problem = self.trust_problem()
        if problem:
            return None, problem
        try:
            with open(path, "rb") as handle:
                raw = handle.read(MAX_RECORD_BYTES + 1)
        except FileNotFoundError:
            return None, None
        except OSError as error:
            return None, f"record {path} is unreadable: {error.strerror or error}"
        if len(raw) > MAX_RECORD_BYTES:
            return None, f"record {path} is corrupt: larger than {MAX_RECORD_BYTES} bytes"
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as error:
            return None, f"record {path} is corrupt: {error}"
        problem = validation_problem(record, path)
        return (None, problem) if problem else (record, None)

    def scan(self):
        """``[(record, problem), ...]`` for every record file here (problem None for a usable one)."""
        problem = self.trust_problem()
        if problem:
            return [(None, problem)]
        try:
            names = sorted(os.listdir(self.directory))
        except OSError:
            return []
        return [self.read(path=os.path.join(self.directory, name)) for name in names
                if name.startswith(RECORD_PREFIX) and name.endswith(".json")]

    def write(self, key, record):
        """Write ``record`` atomically (the caller holds ``lock``); the problem sentence, or None."""
        path = self.record_path(key)
        self._remove_stale_temporaries(os.path.basename(path))
        data = json.dumps(_finite(record), indent=1, sort_keys=True, allow_nan=False).encode("utf-8")
        try:
            fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                             dir=self.directory)
        except OSError as error:
            return f"record {path} cannot be written: {error.strerror or error}"
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        except OSError as error:
            try:
                os.unlink(temporary)
            except OSError:
                pass
            return f"record {path} cannot be written: {error.strerror or error}"
        return None

    def _remove_stale_temporaries(self, name):
        # Writers hold the lock, so a temporary left beside the record is from a killed writer.
        try:
            for entry in os.listdir(self.directory):
                if entry.startswith(f".{name}.") and entry.endswith(".tmp"):
                    os.unlink(os.path.join(self.directory, entry))
        except OSError:
            pass

    def append_event(self, key, event):
        """Append one event line; the problem sentence, or None."""
        problem = self.prepare()
        if problem:
            return problem
        path = self.events_path(key)
        line = (json.dumps(event, sort_keys=True, default=str) + "\n").encode("utf-8")
        try:
            if os.path.getsize(path) > MAX_EVENTS_BYTES:
                os.replace(path, path + ".1")  # one old generation is kept
        except OSError:
            pass
        try:
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError as error:
            return f"events file {path} cannot be written: {error.strerror or error}"
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line  # end a line cut by a killed writer, so this one stays whole
            os.write(fd, line)  # one write of one line: appends from several processes don't interleave
        except OSError as error:
            return f"events file {path} cannot be written: {error.strerror or error}"
        finally:
            os.close(fd)
        return None

    def events(self, key, fingerprint=None, limit=EVENTS_SHOWN):
        """The last ``limit`` events of a device (of one fingerprint when given); bad lines are skipped."""
        if self.trust_problem():
            return []
        try:
            with open(self.events_path(key), "rb") as handle:
                handle.seek(0, os.SEEK_END)
                size = handle.tell()
                handle.seek(max(0, size - MAX_EVENTS_BYTES))
                lines = handle.read().splitlines()
        except OSError:
            return []
        events = []
        for line in lines:
            try:
                event = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                continue  # a line cut by a killed writer
            if isinstance(event, dict) and (fingerprint is None or event.get("fingerprint_id") == fingerprint):
                events.append(event)
        return events[-limit:]


def _finite(value):
    """JSON has no NaN or infinity: such a measurement is kept as its text ("nan", "inf")."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def validation_problem(record, path):
    """Why a parsed record can't be used (None when it can)."""
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return f"record {path} is corrupt: not a {FORMAT} document"
    if record.get("schema_version") != SCHEMA_VERSION:
        return (f"record {path} has schema version {record.get('schema_version')!r}; "
                f"this biv100-patch reads version {SCHEMA_VERSION}")
    missing = [key for key in REQUIRED_KEYS if key not in record]
    if missing:
        return f"record {path} is corrupt: missing {', '.join(missing)}"
    decision = record["decision"]
    if not isinstance(decision, dict) or decision.get("backend") not in BACKENDS:
        return f"record {path} is corrupt: decision.backend is not one of {', '.join(BACKENDS)}"
    return None


def now():
    """``(iso timestamp, unix seconds)`` in UTC."""
    unix = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix)), unix


def summary_line(text, limit=200):
    """One line for an error: its first line, and its last when there are more (Triton's compile
    errors start with the source position and end with the message)."""
    lines = [line.strip() for line in str(text or "").splitlines() if line.strip()]
    if not lines:
        return "no error text"
    line = lines[0] if len(lines) == 1 else f"{lines[0]} … {lines[-1]}"
    return line if len(line) <= limit else line[:limit] + " …"


def safe_text(text, limit=2000):
    """Error text for the record: printable, bounded."""
    text = re.sub(r"[^\S\n]+", " ", str(text)).strip()
    return text if len(text) <= limit else text[:limit] + " …"
