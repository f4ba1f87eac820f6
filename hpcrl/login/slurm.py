"""The one module that talks to Slurm: sbatch, squeue, sacct, scancel, scontrol.

Every call is a subprocess bounded by a timeout (env HPCRL_SLURM_TIMEOUT, default 10 s), so a hung
slurmctld makes a command fail with SlurmUnavailable instead of hanging the login shell. The
parse_* functions are pure (text in, JobInfo out) and are tested on output captured from Slurm 22.05.

squeue is asked in text (`-O` with the fields below), never `--json`: on 22.05.8 `squeue --json`
ignores -j/-t/-u, writes every job slurmctld holds and cost 26-56 ms against ~5 ms for the text
(scripts/bench_cli.py), and the text has every field `hpcrl status` shows, the requeue count
(RestartCnt) and the exit code included.

Known Slurm quirks this module works around (seen on 22.05.8):
  * squeue's `exit_code` is the raw wait(2) status (exit 3 -> 768, SIGKILL -> 9); sacct gives
    "3:0", or {"return_code": .., "signal": ..} objects in JSON.  All are decoded.
  * `sacct --json` reports exit code 0 for jobs that exited 3 (the text `ExitCode` is right), so a
    FAILED job with "0:0" in sacct JSON gets its exit code re-read from `sacct -P`.
  * squeue against a dead controller retries for ~18 s before it fails; `scontrol ping` answers
    at once, so query() pings while squeue starts, and stops squeue when the ping says DOWN.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections import namedtuple
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["SlurmError", "SlurmUnavailable", "JobInfo", "FINISHED_STATES", "submit", "query", "cancel", "ping",
           "parse_sacct_json", "parse_squeue_text", "parse_sacct_text", "parse_slurm_time"]

DEFAULT_TIMEOUT = 10.0
PING_TIMEOUT = 5.0

# States after which a job never runs again (without an explicit requeue): the one list every
# login module asks (JobInfo.finished). A requeued job leaves them; until then a job in one of them
# needs no new query (`hpcrl status` shows the state the registry recorded).
FINISHED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                             "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "REVOKED"})

# stderr fragments that mean "could not reach slurmctld/slurmdbd", not "Slurm said no".
_UNREACHABLE = re.compile(r"Unable to contact slurm controller|connect failure|Connection refused|"
                          r"Socket timed out|Zero Bytes were transmitted|Problem talking to the database",
                          re.IGNORECASE)
# stderr fragments that mean this build of Slurm cannot write JSON (no openapi/data_parser plugin,
# or a release older than 21.08 that has no --json at all).
_NO_JSON = re.compile(r"json|serializ|unrecognized option|invalid option|openapi|data_parser",
                      re.IGNORECASE)
_INVALID_ID = "Invalid job id specified"

# Per process: commands whose JSON output (or accounting) turned out to be unavailable, so that we
# do not pay for the failing call again.  Keys: "sacct --json", "sacct".
_broken: set[str] = set()

# Text output. The job name goes last: it is the one free-text field and may contain the '|'.
_SQUEUE_FIELDS = ("JobID", "State", "Reason", "TimeUsed", "TimeLimit", "NumNodes", "NodeList",
                  "exit_code", "RestartCnt", "UserName", "WorkDir", "STDOUT", "SubmitTime", "StartTime",
                  "EndTime", "Name")
SQUEUE_FORMAT = ",".join(f"{f}:|" for f in _SQUEUE_FIELDS[:-1]) + f",{_SQUEUE_FIELDS[-1]}:"
_SACCT_FIELDS = ("JobIDRaw", "State", "Reason", "ElapsedRaw", "TimelimitRaw", "NNodes", "NodeList",
                 "ExitCode", "WorkDir", "Submit", "Start", "End", "JobName")


class SlurmError(Exception):
    """A Slurm command failed; the message names the command and Slurm's stderr on one line."""

    def __init__(self, command: str, detail: str):
        super().__init__(f"{command}: {detail}")
        self.command, self.detail = command, detail   # detail: Slurm's own words


class SlurmUnavailable(SlurmError):
    """slurmctld (or a Slurm command) did not answer within the bound, refused, or is not installed."""


# (name, default) of each JobInfo field. A named tuple, not a dataclass: importing dataclasses
# (and the inspect module it pulls in) costs `hpcrl status` ~8 ms, a third of its budget.
_JOBINFO = (
    ("job_id", None),
    ("name", ""),
    ("state", "UNKNOWN"),
    ("reason", ""),            # why it pends (JobHeldUser, Priority...) or why it ended (NonZeroExitCode)
    ("elapsed_s", None),
    ("time_limit_s", None),    # None: unlimited or unknown
    ("nodes", None),
    ("node_list", ""),
    ("exit_code", None),       # set once the job has finished
    ("signal", None),          # the signal that ended the job (0: none); set once finished
    ("restarts", 0),           # times Slurm requeued it (squeue; sacct only on newer Slurm)
    ("work_dir", ""),
    ("std_out", ""),
    ("submit_time", None),
    ("start_time", None),      # actual start; None while pending
    ("end_time", None),        # actual end; None until finished
)


class JobInfo(namedtuple("JobInfo", [f for f, _ in _JOBINFO], defaults=[d for _, d in _JOBINFO[1:]])):
    """What Slurm says about one job. Times are unix seconds; None where Slurm has no value."""

    __slots__ = ()

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_STATES

    def to_dict(self) -> dict:
        return self._asdict()

    @classmethod
    def from_dict(cls, d: dict) -> JobInfo:
        """Inverse of to_dict; ignores keys it does not know (a registry row from another version)."""
        return cls(**{k: v for k, v in d.items() if k in cls._fields})


# ----------------------------------------------------------------------------- running commands

def _timeout() -> float:
    try:
        return float(os.environ.get("HPCRL_SLURM_TIMEOUT", DEFAULT_TIMEOUT))
    except ValueError:
        return DEFAULT_TIMEOUT


def _start(cmd: list[str], cwd: Path | None = None, epoch_times: bool = False) -> subprocess.Popen:
    """Start a Slurm command (its output read by _wait); SlurmUnavailable if it is not installed."""
    env = dict(os.environ)
    if "--json" in cmd:
        # 22.05 parses its own query times with SLURM_TIME_FORMAT: "%s" makes sacct --json ignore
        # -j. JSON times are epoch seconds anyway.
        env.pop("SLURM_TIME_FORMAT", None)
    elif epoch_times:
        env["SLURM_TIME_FORMAT"] = "%s"   # text output in epoch seconds: no timezone guessing
    try:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                                env=env, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise SlurmUnavailable(cmd[0], "command not found (is Slurm installed on this node?)") from None


def _wait(p: subprocess.Popen, timeout: float | None = None) -> str:
    """A started command's stdout; SlurmError/SlurmUnavailable when it fails or outlives timeout."""
    timeout = _timeout() if timeout is None else timeout
    shown = " ".join(p.args)
    shown = shown if len(shown) <= 160 else shown[:157] + "..."   # -j with many ids
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise SlurmUnavailable(shown, f"no answer within {timeout:g} s (slurmctld down or overloaded?)") \
            from None
    if p.returncode != 0:
        said = err.strip() or out.strip()   # scontrol ping reports DOWN on stdout
        detail = "; ".join(line.strip() for line in said.splitlines() if line.strip())[:400]
        exc = SlurmUnavailable if _UNREACHABLE.search(said) else SlurmError
        raise exc(shown, detail or f"exit status {p.returncode}")
    return out


def _run(cmd: list[str], timeout: float | None = None, cwd: Path | None = None,
         epoch_times: bool = False) -> str:
    """Run a Slurm command and return its stdout; raise SlurmError/SlurmUnavailable otherwise."""
    return _wait(_start(cmd, cwd, epoch_times), timeout)


def _ping(timeout: float = PING_TIMEOUT, started: subprocess.Popen | None = None) -> None:
    """Raise SlurmUnavailable unless a slurmctld (primary or backup) says it is UP."""
    try:
        out = _wait(started or _start(["scontrol", "ping"]), timeout=min(timeout, _timeout()))
    except SlurmError as e:   # scontrol ping exits 1 when the controller is DOWN
        raise SlurmUnavailable(e.command, e.detail) from None
    if " is UP" not in out:
        raise SlurmUnavailable("scontrol ping", " ".join(out.split()) or "no answer")


def ping(timeout: float = PING_TIMEOUT) -> bool:
    """True when a slurmctld (primary or backup) says it is UP; answers within `timeout` seconds."""
    try:
        _ping(timeout)
    except SlurmUnavailable:
        return False
    return True


def submit(script_path: Path, cwd: Path, extra_args: Iterable[str] = ()) -> str:
    """sbatch the script from cwd and return the job id.

    On SlurmUnavailable after a timeout the job may still have been queued: sbatch can be killed
    after slurmctld accepted it.
    """
    out = _run(["sbatch", "--parsable", *extra_args, str(script_path)], cwd=Path(cwd)).strip()
    job_id = out.splitlines()[-1].split(";")[0].strip() if out else ""   # "123" or "123;cluster"
    if not re.fullmatch(r"\d+", job_id):
        raise SlurmError(f"sbatch --parsable {script_path}", f"unexpected output {out!r}")
    return job_id


def cancel(job_id: str) -> None:
    """scancel; cancelling a job that already ended is not an error (scancel says nothing)."""
    _run(["scancel", str(job_id)])


def signal_batch(job_id: str, signal_name: str) -> None:
    """Send a signal to a running job's batch script only (its trap decides what the step gets)."""
    _run(["scancel", "--batch", f"--signal={signal_name}", str(job_id)])


# ------------------------------------------------------------------------------------- query

def query(job_ids: Iterable[str]) -> dict[str, JobInfo]:
    """State of each job id: from squeue while slurmctld remembers the job, else from sacct.

    Ids that neither knows come back with state UNKNOWN and the reason why. Raises SlurmUnavailable
    when slurmctld does not answer; a failing sacct only makes its jobs UNKNOWN.
    """
    ids = list(dict.fromkeys(str(j) for j in job_ids))
    if not ids:
        return {}
    found = _from_squeue(ids)
    # sacct for jobs slurmctld has forgotten, and for finished jobs whose exit code squeue's
    # output did not tell.
    ask = [j for j in ids if j not in found or (found[j].finished and found[j].exit_code is None)]
    for j, acct in (_from_sacct(ask) if ask else {}).items():
        live = found.get(j)
        if live is None:
            found[j] = acct
        elif acct.state != "UNKNOWN":   # keep what only squeue knows
            found[j] = acct._replace(reason=acct.reason or live.reason, std_out=acct.std_out or live.std_out,
                                     restarts=max(acct.restarts, live.restarts))
    return {j: found.get(j) or JobInfo(j, reason="not known to squeue or sacct") for j in ids}


def _from_squeue(ids: list[str]) -> dict[str, JobInfo]:
    # The ping and squeue run at once: a dead slurmctld costs squeue ~18 s of connect retries but
    # scontrol ping an instant (then squeue is stopped), and a live one costs the two processes'
    # start-up once, not twice.
    ping = _start(["scontrol", "ping"])
    try:
        squeue = _start(["squeue", "-h", "-t", "all", "-j", ",".join(ids), "-O", SQUEUE_FORMAT],
                        epoch_times=True)
    except SlurmUnavailable:
        ping.kill()
        ping.communicate()
        raise
    try:
        _ping(started=ping)
        jobs = parse_squeue_text(_wait(squeue))
    except SlurmError as e:
        if _INVALID_ID in e.detail:   # every id has aged out of slurmctld: ask sacct
            return {}
        raise
    finally:
        if squeue.poll() is None:     # the ping failed: do not wait out squeue's retries
            squeue.kill()
            squeue.communicate()
    # squeue may answer about other jobs than those asked (an array's tasks)
    return {j: jobs[j] for j in ids if j in jobs}


def _from_sacct(ids: list[str]) -> dict[str, JobInfo]:
    try:
        if "sacct" in _broken:   # accounting storage disabled: the job completion log may have it
            return _sacct_text(ids, "-c")
        if "sacct --json" not in _broken:
            try:
                jobs = parse_sacct_json(_run(["sacct", "--json", "-X", "-j", ",".join(ids)]))
            except SlurmError as e:
                if not _json_unsupported(e):
                    raise
                _broken.add("sacct --json")
            else:
                # 22.05 writes exit code 0 for failed jobs in JSON (its text is right); a FAILED
                # job cannot have ended 0:0, so re-read those from the text output.
                suspect = [j for j, i in jobs.items() if i.state == "FAILED" and not i.exit_code
                           and not i.signal]
                fixed = _sacct_text(suspect) if suspect else {}
                for j in suspect:
                    if j in fixed:
                        jobs[j] = jobs[j]._replace(exit_code=fixed[j].exit_code,
                                                      signal=fixed[j].signal)
                return jobs
        return _sacct_text(ids)
    except SlurmError as e:
        if "accounting storage is disabled" in e.detail and "sacct" not in _broken:
            _broken.add("sacct")
            return _from_sacct(ids)
        return {j: JobInfo(j, reason=f"sacct failed: {e}") for j in ids}


def _sacct_text(ids: list[str], *flags: str) -> dict[str, JobInfo]:
    # -X: the allocation only, not its steps; -D: every attempt of a requeued job (one record
    # each), so that its restarts can be counted
    return parse_sacct_text(_run(["sacct", *flags, "-P", "-n", "-X", "-D", "-j", ",".join(ids),
                                  "-o", ",".join(_SACCT_FIELDS)], epoch_times=True))


def _json_unsupported(e: SlurmError) -> bool:
    return (not isinstance(e, SlurmUnavailable) and _INVALID_ID not in e.detail
            and "accounting storage is disabled" not in e.detail and bool(_NO_JSON.search(e.detail)))


# ----------------------------------------------------------------------------- pure parsing

def parse_slurm_time(text: str | None) -> int | None:
    """Seconds in a Slurm duration: "1-02:03:04", "05:00" (mm:ss), "30" (minutes), "2-12" (d-h).

    None for UNLIMITED, INFINITE, Partition_Limit, N/A and the like.
    """
    text = (text or "").strip()
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not m:
        return None
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is None:     # "m", "m:s", "h:m:s"
        if b is None:
            return a * 60
        return a * 60 + b if c is None else a * 3600 + b * 60 + c
    # with days: "d-h", "d-h:m", "d-h:m:s"
    return days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)


def _num(v) -> int | None:
    """An integer field: plain (22.05) or {"set", "infinite", "number"} (23.02+). 0 means unset."""
    if isinstance(v, dict):
        if not v.get("set", True) or v.get("infinite"):
            return None
        v = v.get("number")
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _time(v) -> int | None:
    t = _num(v)
    return t if t else None   # Slurm writes 0 for "no such time yet"


def _first(v) -> str:
    """A state: "RUNNING" (22.05) or ["RUNNING", "COMPLETING"] (23.02+)."""
    if isinstance(v, list):
        v = v[0] if v else ""
    return str(v or "")


def _reason(v) -> str:
    v = str(v or "")
    return "" if v == "None" else v


def _exit(v) -> tuple[int | None, int | None]:
    """(return code, signal) from an exit_code field of any release."""
    if isinstance(v, dict):
        rc = _num(v.get("return_code"))
        sig = v.get("signal")
        if isinstance(sig, dict):   # 22.05 sacct: {"signal_id": 15}; 23.02+: {"id": {"number": 15}}
            sig = sig.get("signal_id", sig.get("id"))
        return (rc or 0), (_num(sig) or 0)
    if isinstance(v, int):          # 22.05 squeue: a raw wait status
        return (v >> 8) & 0xFF, v & 0x7F
    return None, None


def _errors(doc: dict, cmd: str) -> None:
    # sacct reports "Nothing found" (9003) as an error when no id matched: that is an empty answer.
    errs = [e for e in doc.get("errors") or [] if isinstance(e, dict) and e.get("error_number") != 9003]
    if errs:
        msg = "; ".join(f"{e.get('source', '')}: {e.get('description') or e.get('error', '')}" for e in errs)
        raise SlurmError(f"{cmd} --json", msg)


def _std_out(pattern: str, job_id: str, name: str, work_dir: str, user: str = "",
             array_id: int | None = None, task: int | None = None) -> str:
    """The batch script's stdout file. squeue 22.05 gives the raw --output pattern ("" = default)."""
    pattern = pattern or ("slurm-%A_%a.out" if task is not None else "slurm-%j.out")
    subst = {"j": job_id, "x": name, "u": user, "A": str(array_id or job_id), "a": str(task or 0), "%": "%"}
    out = re.sub(r"%(\d*)([jxuAa%])", lambda m: subst[m.group(2)].zfill(int(m.group(1) or 0)), pattern)
    return out if out.startswith("/") or not work_dir else f"{work_dir}/{out}"


def _finish(state: str, rc: int | None, sig: int | None) -> tuple[int | None, int | None]:
    """Exit code and signal only mean something once the job has ended."""
    return (rc, sig) if state in FINISHED_STATES else (None, None)


def _attempts_before(jobs: dict[str, JobInfo], job_id: str) -> int:
    """How many records of `job_id` came before this one: sacct -D writes one for each attempt."""
    return jobs[job_id].restarts + 1 if job_id in jobs else 0


def parse_sacct_json(text: str) -> dict[str, JobInfo]:
    """`sacct --json -X` output -> {job_id: JobInfo}. A requeued job has a record for each attempt:
    the last wins, and the ones before it are its restarts (22.05 has no restart_cnt)."""
    doc = json.loads(text)
    _errors(doc, "sacct")
    jobs = {}
    for j in doc.get("jobs", []):
        job_id = str(j["job_id"])
        st = j.get("state") or {}
        state = _first(st.get("current"))
        t = j.get("time") or {}
        start, end = _time(t.get("start")), _time(t.get("end"))
        limit = _num(t.get("limit"))
        rc, sig = _finish(state, *_exit(j.get("exit_code")))
        nodes = j.get("nodes") or ""
        jobs[job_id] = JobInfo(
            job_id=job_id, name=j.get("name", ""), state=state, reason=_reason(st.get("reason")),
            elapsed_s=_num(t.get("elapsed")) if start else None,
            time_limit_s=limit * 60 if limit is not None else None,
            nodes=_num(j.get("allocation_nodes")), node_list="" if nodes == "None assigned" else nodes,
            exit_code=rc, signal=sig, restarts=max(_num(j.get("restart_cnt")) or 0, _attempts_before(jobs, job_id)),
            work_dir=j.get("working_directory", ""),
            std_out=j.get("stdout_expanded") or "",   # 24.05+; older sacct does not know it
            submit_time=_time(t.get("submission")), start_time=start, end_time=end if end and start else None)
    return jobs


def _int(s: str) -> int | None:
    return int(s) if s.strip().isdigit() else None


def _split(text: str, n: int) -> Iterator[list[str]]:
    for line in text.splitlines():
        if line.strip():
            parts = line.split("|", n - 1)
            if len(parts) == n:
                yield parts


def parse_squeue_text(text: str) -> dict[str, JobInfo]:
    """`squeue -h -O SQUEUE_FORMAT` output (see _SQUEUE_FIELDS), times as epoch seconds."""
    jobs = {}
    for (job_id, state, reason, used, limit, nodes, node_list, exit_code, restarts, user, work_dir, std_out,
         submit, start, end, name) in _split(text, len(_SQUEUE_FIELDS)):
        state = state.split()[0] if state.strip() else ""
        name = name.strip()
        # while pending, StartTime is the scheduler's guess; while running, EndTime is the limit
        start_t = _int(start) if state not in ("PENDING", "REQUEUED", "REQUEUE_HOLD") else None
        rc, _, sig = exit_code.partition(":")   # 22.05: a raw wait status ("768"); "3:0" elsewhere
        code = _exit(_int(rc)) if not sig else (_int(rc), _int(sig))
        rc, sig = _finish(state, *code)
        # squeue prints the limit as "5:00" for 5 minutes: parse_slurm_time's m:ss
        jobs[job_id] = JobInfo(
            job_id=job_id, name=name, state=state, reason=_reason(reason),
            elapsed_s=parse_slurm_time(used) if start_t else None, time_limit_s=parse_slurm_time(limit),
            nodes=_int(nodes), node_list=node_list, exit_code=rc, signal=sig, restarts=_int(restarts) or 0,
            work_dir=work_dir, std_out=_std_out(std_out, job_id, name, work_dir, user) if std_out else "",
            submit_time=_int(submit), start_time=start_t,
            end_time=_int(end) if state in FINISHED_STATES else None)
    return jobs


def parse_sacct_text(text: str) -> dict[str, JobInfo]:
    """`sacct -P -n -X -D -o JobIDRaw,State,...,JobName` output (see _SACCT_FIELDS), epoch times; a
    requeued job's last record wins, and the ones before it are its restarts."""
    jobs = {}
    for (job_id, state, reason, elapsed, limit, nodes, node_list, exit_code, work_dir, submit, start,
         end, name) in _split(text, len(_SACCT_FIELDS)):
        state = state.split()[0] if state.strip() else ""   # "CANCELLED by 1000" -> CANCELLED
        rc, _, sig = exit_code.partition(":")   # "3:0": return code 3, no signal
        rc, sig = _finish(state, _int(rc), _int(sig))
        start_t = _int(start)
        jobs[job_id] = JobInfo(
            job_id=job_id, name=name, state=state, reason=_reason(reason),
            # TimelimitRaw is plain minutes ("1560"), which parse_slurm_time reads as such
            elapsed_s=_int(elapsed) if start_t else None, time_limit_s=parse_slurm_time(limit),
            nodes=_int(nodes), node_list="" if node_list == "None assigned" else node_list,
            exit_code=rc, signal=sig, restarts=_attempts_before(jobs, job_id),
            work_dir=work_dir, submit_time=_int(submit), start_time=start_t,
            end_time=_int(end) if start_t else None)
    return jobs
