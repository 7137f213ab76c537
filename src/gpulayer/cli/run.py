"""``gpulayer run``: submit a job, stream its logs, exit with its code."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from .. import defaults
from ..arrays import span, tally
from ..client import Client, Job
from ..errors import GPUlayerError, SpecError, WaitTimeout
from .root import GLOBAL_OPTIONS, _client, main

# How `gpulayer run` exits for each final state (a failed job passes its own code on).
EXIT_CODES = {"succeeded": 0, "failed": 1, "cancelled": 130, "timed_out": 124, "lost": 1}

SUBMIT_KEYS = (
    "script",
    "args",
    "command",
    "source",
    "inputs",
    "outputs",
    "env",
    "gpus",
    "nodes",
    "procs_per_node",
    "launcher",
    "priority",
    "max_retries",
    "retry_delay",
    "timeout",
    "name",
    "labels",
    "warm",
    "project",
    "preemptible",
    "after",
    "after_any",
    "array",
    "max_parallel",
)


def _pairs(values: Sequence[str], option: str) -> dict[str, str]:
    found = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected NAME=VALUE, got {value!r}", param_hint=option)
        found[key] = rest
    return found


def _load_yaml(path: str) -> dict[str, Any]:
    import difflib

    import yaml

    file = Path(path)
    try:
        data = yaml.safe_load(file.read_text())
    except OSError as exc:
        raise SpecError("file", f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise SpecError("file", f"{path} is not valid YAML: {_yaml_error(exc)}") from None
    if not isinstance(data, dict):
        raise SpecError("file", f"{path} must hold a mapping of job fields")
    unknown = sorted(str(k) for k in set(data) - set(SUBMIT_KEYS))
    if unknown:
        guess = difflib.get_close_matches(unknown[0], SUBMIT_KEYS, n=1, cutoff=0.6)
        hint = f"; did you mean {guess[0]!r}?" if guess else ""
        raise SpecError(
            unknown[0],
            f"unknown field in {path}{hint} (fields: {', '.join(SUBMIT_KEYS)})",
        )
    base = file.resolve().parent
    for key in ("script", "source"):
        if isinstance(data.get(key), str):
            data[key] = str(base / data[key])
    if isinstance(data.get("inputs"), dict):
        data["inputs"] = {k: str(base / str(v)) for k, v in data["inputs"].items()}
    return data


def _yaml_error(exc: Exception) -> str:
    """A YAML error as "line L, column C: what", lines counted from 1 (the
    parser's own text names "<unicode string>" for the file)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    what = f"{problem} ({context})" if context else str(problem)
    if mark is None:
        return what
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}"


# The global options (root.py) are `run`'s only before the target: after it,
# a script's own --token, --home or --server (a Hugging Face token, a data
# folder, its own server) is the script's, as before they were accepted
# after a command's name. Such a word is marked so that the parser hands it
# on as an argument; run() takes the mark off.
_JOB_WORD = "\0gpulayer-job-word:"


class _RunCommand(click.Command):
    """``run``, which also remembers where ``--`` was (a word after it is
    the job's, whatever it looks like) and keeps the global options after
    the target for the job."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["gpulayer.after_dashes"] = args[args.index("--") + 1 :] if "--" in args else []
        return super().parse_args(ctx, self._globals_after_target_to_the_job(args))

    def _globals_after_target_to_the_job(self, args: list[str]) -> list[str]:
        valued = {
            name
            for p in self.params
            if isinstance(p, click.Option) and not p.is_flag and not p.count
            for name in (*p.opts, *p.secondary_opts)
        }
        globals_ = {"--" + name.replace("_", "-") for name in GLOBAL_OPTIONS}
        out: list[str] = []
        target_seen = False
        words = iter(args)
        for word in words:
            if word == "--":
                out += [word, *words]
                break
            name = word.split("=", 1)[0]
            if target_seen and name in globals_:
                out.append(_JOB_WORD + word)
                if "=" not in word:  # and its value, whatever it looks like
                    out += [_JOB_WORD + w for w in itertools.islice(words, 1)]
                continue
            out.append(word)
            if word.startswith("-") and len(word) > 1:
                if name in valued and "=" not in word:
                    out += list(itertools.islice(words, 1))  # its value
            else:
                target_seen = True
        return out


@main.command(
    cls=_RunCommand,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True},
)
@click.argument("target", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "-f",
    "--file",
    "job_file",
    type=click.Path(dir_okay=False, exists=True),
    help="A job described in YAML.",
)
@click.option("--gpus", type=int, help="Whole GPUs per node.")
@click.option("--nodes", type=int, help="Nodes (tasks) for a distributed job.")
@click.option("--procs-per-node", type=int, help="Ranks per node.")
@click.option(
    "--launcher", type=click.Choice(["direct", "torchrun"]), help="Launcher for distributed jobs."
)
@click.option(
    "--input", "inputs", multiple=True, metavar="NAME=PATH", help="A file or folder the job reads."
)
@click.option(
    "--output",
    "outputs",
    multiple=True,
    metavar="PATH",
    help="A path (or glob) to keep when it ends.",
)
@click.option(
    "--env", "env", multiple=True, metavar="K=V", help="An environment variable for the job."
)
@click.option(
    "--secret",
    "secrets",
    multiple=True,
    metavar="NAME[=VALUE]",
    help="An environment variable whose value is stored encrypted and never shown back; "
    "NAME alone passes this shell's $NAME.",
)
@click.option(
    "--env-file",
    "env_files",
    multiple=True,
    type=click.Path(dir_okay=False, exists=True),
    help="A file of NAME=VALUE lines, each passed as a --secret.",
)
@click.option("--label", "labels", multiple=True, metavar="K=V", help="A label to find the job by.")
@click.option(
    "--source",
    type=click.Path(file_okay=False, exists=True),
    help="Folder to ship (default: the script's).",
)
@click.option("--priority", type=int, help="Higher runs first.")
@click.option("--retries", "max_retries", type=int, help="Times to retry a failed or lost job.")
@click.option(
    "--retry-delay",
    type=float,
    metavar="SECONDS",
    help="Wait before the first retry, doubled before each next one (default 1 s, "
    "up to 300 s; 0 retries at once).",
)
@click.option("--timeout", type=float, help="Seconds before the job is terminated.")
@click.option(
    "--no-warm",
    "no_warm",
    is_flag=True,
    default=None,
    help="Start the script in a new interpreter, not as a fork of the worker's ready one.",
)
@click.option("--name", help="A name for the job.")
@click.option("--project", help="The project it goes into, one of yours (default: your first).")
@click.option(
    "--after",
    "after",
    multiple=True,
    metavar="JOB",
    help="Wait for this job to succeed (cancelled if it does not). Repeat for several.",
)
@click.option(
    "--after-any",
    "after_any",
    multiple=True,
    metavar="JOB",
    help="Wait for this job to end, whatever way. Repeat for several.",
)
@click.option(
    "--array",
    "array",
    metavar="SPEC",
    help="A sweep: one task per index, e.g. 0-99, 1,5,9, 0-99:10; %N: at most N at once "
    "(0-99%8). Each task reads its index as GPULAYER_ARRAY_INDEX.",
)
@click.option(
    "--max-parallel",
    "max_parallel",
    type=click.IntRange(min=1),
    metavar="N",
    help="At most N tasks of the array running at once (as %N).",
)
@click.option(
    "--preemptible",
    is_flag=True,
    default=None,
    help="It may be stopped for a job of higher priority, and queued again without "
    "using a retry (it gets GPULAYER_PREEMPT_NOTICE).",
)
@click.option(
    "--workers",
    type=int,
    help="Local workers to start (default: 1 embedded, none with a server).",
)
@click.option("--slots", type=int, help="Slots per local CPU worker (GPU workers: one per GPU).")
@click.option(
    "--follow/--detach", default=True, help="Stream logs and wait (default), or return at once."
)
@click.option(
    "--download/--no-download", default=True, help="Fetch outputs into gpulayer_runs/ at the end."
)
@click.pass_context
def run(
    ctx: click.Context,
    /,
    target: str | None,
    args: tuple[str, ...],
    job_file: str | None,
    workers: int | None,
    slots: int | None,
    follow: bool,
    download: bool,
    **flags: Any,
) -> None:
    """Run TARGET (a .py script, or any command) as a job.

    Logs stream to this terminal and the command exits with the job's exit
    code. GPUlayer's own options may come before or after TARGET; arguments
    it does not know go to the job. After `--`, everything goes to the job.
    """
    kept = [w[len(_JOB_WORD) :] for w in args if w.startswith(_JOB_WORD)]
    args = tuple(w.removeprefix(_JOB_WORD) for w in args)
    _check_option_words(ctx, target, args, kept)
    fields = _load_yaml(job_file) if job_file else {}
    if target is not None:
        if target.endswith(".py"):
            fields["script"], fields["args"] = target, list(args)
        else:
            fields["command"], fields["args"] = [target, *args], []
    if "script" not in fields and "command" not in fields:
        raise click.UsageError("give a script or command to run, or -f job.yaml")
    for key, option in (("inputs", "--input"), ("env", "--env"), ("labels", "--label")):
        if flags[key]:
            fields[key] = {**fields.get(key, {}), **_pairs(flags[key], option)}
    if flags["outputs"]:
        fields["outputs"] = [*fields.get("outputs", []), *flags["outputs"]]
    secrets = _secrets(flags["env_files"], flags["secrets"])
    if secrets:
        fields["secrets"] = secrets
    for key in _pairs(flags["env"], "--env"):
        if _CREDENTIAL_NAME.search(key):
            click.echo(
                f"gpulayer: warning: --env {key} is stored and shown in plain text; "
                f"a credential goes in --secret {key}",
                err=True,
            )
    for key in (
        "gpus",
        "nodes",
        "procs_per_node",
        "launcher",
        "source",
        "priority",
        "max_retries",
        "retry_delay",
        "timeout",
        "name",
        "project",
        "array",
        "max_parallel",
    ):
        if flags[key] is not None:
            fields[key] = flags[key]
    if flags["no_warm"]:
        fields["warm"] = False
    if flags["preemptible"]:
        fields["preemptible"] = True
    for key in ("after", "after_any"):
        if flags[key]:
            listed = fields.get(key) or []
            if isinstance(listed, str):  # one job, as the client takes it
                listed = [listed]
            if not isinstance(listed, list):
                raise SpecError(key, f"give a job id or a list of them, not {listed!r}")
            fields[key] = [*listed, *flags[key]]
    client = _client(ctx)
    if not follow and ctx.obj["server"] is None:
        raise click.UsageError(
            "--detach needs a server: an embedded job runs only while this command does"
        )
    if workers is None:  # embedded: enough local workers for every node
        workers = 0 if ctx.obj["server"] else max(1, int(fields.get("nodes", 1)))
    if workers:
        client.ensure_local_workers(workers, slots=slots)
    job = client.submit(**fields)
    click.echo(f"gpulayer: job {job.id} submitted", err=True)
    if not follow:
        click.echo(job.id)
        return
    # SIGTERM and SIGHUP (a closed terminal, a `kill`) cancel the job as
    # Ctrl-C does: the job belongs to this command, and must not run on
    # unseen once it is gone.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    try:
        if job.info.spec.array:
            _follow_array(job)
        else:
            _stream(job, client)
        state = job.wait()
    except KeyboardInterrupt:
        # A second signal while it is cancelled: exit now (a server still
        # cancels it; embedded, the next command ends what is left).
        _exit_on_next_signal()
        click.echo(f"\ngpulayer: cancelling job {job.id} (again to exit at once)", err=True)
        state = job.cancel()
        state = job.wait()
    info = job.info
    total = info.timings().get("total")
    took = f" in {total:.2f} s" if total is not None else ""
    click.echo(f"gpulayer: job {job.id} {state}{took}", err=True)
    if info.reason:  # why it failed; for a success, e.g. a declared output that is missing
        click.echo(f"gpulayer: {info.reason.splitlines()[0]}", err=True)
    if download and info.outputs:
        click.echo(f"gpulayer: outputs in {job.download_outputs()}", err=True)
    code = EXIT_CODES.get(state, 1)
    if state == "failed" and info.exit_code:
        code = info.exit_code if info.exit_code > 0 else 128 - info.exit_code
    ctx.exit(code)


# Names of variables that usually hold a credential (said of an --env).
_CREDENTIAL_NAME = re.compile(
    r"TOKEN|SECRET|PASSW|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL", re.IGNORECASE
)


def _secrets(env_files: Sequence[str], given: Sequence[str]) -> dict[str, str]:
    """A job's secrets: each --env-file's lines, then each --secret. Errors
    name what is wrong, never a value."""
    from ..secretbox import read_env_file

    found: dict[str, str] = {}
    for path in env_files:
        found.update(read_env_file(path))
    visible = False
    for item in given:
        name, sep, value = item.partition("=")
        if not name:
            raise click.BadParameter("expected NAME or NAME=VALUE", param_hint="--secret")
        if not sep:
            if name not in os.environ:
                raise click.BadParameter(
                    f"${name} is not set here; set it, or give {name}=VALUE",
                    param_hint="--secret",
                )
            value = os.environ[name]
        visible = visible or bool(sep)
        found[name] = value
    if visible:
        click.echo(
            "gpulayer: warning: a --secret NAME=VALUE is visible to every user of this "
            "machine (in `ps`) while this command runs; --secret NAME (from this shell's "
            "environment) and --env-file FILE are not",
            err=True,
        )
    return found


def _stream(job: Job, client: Client | None = None) -> None:
    """The job's log lines as they come, until it ends. With ``client``,
    while it waits to start, why (see _say_why_it_waits)."""
    out, err = sys.stdout, sys.stderr
    started = threading.Event()
    if client is not None:
        threading.Thread(
            target=_say_why_it_waits, args=(client, job.id, started), daemon=True
        ).start()
    try:
        for line in job.stream_logs(follow=True):
            started.set()
            stream = out if line.stream == "stdout" else err
            stream.write(line.render() + "\n")
            stream.flush()
    finally:
        started.set()


def _follow_array(job: Job) -> None:
    """An array's progress, a line each time its tasks' states change
    (their logs: ``gpulayer logs JOB:INDEX``), until it ends."""
    spec = job.info.spec
    limit = f", at most {spec.max_parallel} at once" if spec.max_parallel else ""
    click.echo(
        f"gpulayer: array {job.id}: {len(spec.array)} tasks ({span(spec.array)}){limit}; "
        f"one task's logs: gpulayer logs {job.id}:{spec.array[0]}",
        err=True,
    )
    said = ""
    while True:
        with contextlib.suppress(WaitTimeout):  # (it is still going: say how far)
            job.wait(timeout=_ARRAY_PROGRESS_S)
        now = tally(job.info.array_states)
        if now and now != said:
            click.echo(f"gpulayer: array {job.id}: {now}", err=True)
            said = now
        if job.info.done:
            return


# How often `run` of an array looks at its tasks' states (it returns at once when it ends).
_ARRAY_PROGRESS_S = 2.0


def _say_why_it_waits(client: Client, job_id: str, started: threading.Event) -> None:
    """Once a job has waited WAIT_NOTICE_S without starting, say why, and
    again each time the reason changes, until it starts."""
    said = None
    wait = defaults.WAIT_NOTICE_S
    while not started.wait(wait):
        wait = defaults.WAIT_RECHECK_S
        try:
            info = client.job(job_id).info
        except GPUlayerError:
            return  # the main thread says what went wrong
        if info.state != "queued":
            return
        if info.reason and info.reason != said:
            said = info.reason
            click.echo(f"gpulayer: job {job_id} waits: {said}", err=True)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _exit_on_next_signal() -> None:
    """From now on a signal exits at once, whatever the main thread does.

    A Python handler runs only when the main thread is between bytecodes,
    and the cancel may hold it in one C call for a while (a store's busy
    wait): so the C-level handler's write to the wakeup fd, made at once in
    whichever thread the signal lands on, wakes a thread that exits."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_now)
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=_exit_when_woken, args=(read,), daemon=True).start()


def _exit_when_woken(fd: int) -> None:
    os.read(fd, 1)  # a byte: a signal came
    _exit_now(0, None)


def _exit_now(signum: int, _frame: object) -> None:
    with contextlib.suppress(OSError):
        os.write(2, b"gpulayer: exiting at once\n")
    os._exit(130)


def _check_option_words(
    ctx: click.Context, target: str | None, args: Sequence[str], kept: Sequence[str] = ()
) -> None:
    """A word before the script that looks like an option is a typo of
    GPUlayer's (refused, with the closest option); one after the script is
    the script's, but a close match to one of GPUlayer's is warned of, as is
    a global option there (``kept``: the job's, see _JOB_WORD)."""
    import difflib

    after_dashes = ctx.meta.get("gpulayer.after_dashes", [])
    words = ([target] if target is not None else []) + list(args)
    # Those after `--` are the job's, unexamined.
    mine = words[: len(words) - len(after_dashes)] if after_dashes else words
    names = sorted(
        {o for p in ctx.command.params for o in [*p.opts, *p.secondary_opts] if o.startswith("--")}
    )

    def closest(word: str) -> str | None:
        found = difflib.get_close_matches(word.split("=", 1)[0], names, n=1, cutoff=0.75)
        return found[0] if found else None

    if target is not None and mine and mine[0] == target and target.startswith("-"):
        guess = closest(target)
        hint = f"; did you mean {guess}?" if guess else ""
        raise click.UsageError(
            f"no such option: {target}{hint} (a command that starts with '-' goes after --)"
        )
    globals_ = {"--" + name.replace("_", "-") for name in GLOBAL_OPTIONS}
    for word in mine[1:]:
        if word in kept and word.split("=", 1)[0] in globals_:
            flag = word.split("=", 1)[0]
            click.echo(
                f"gpulayer: warning: {flag} after the script goes to the job; GPUlayer's own "
                f"{flag} goes before the script",
                err=True,
            )
        elif word.startswith("--") and (guess := closest(word)) is not None:
            click.echo(
                f"gpulayer: warning: {word} goes to the job, not to GPUlayer; did you mean "
                f"{guess}? (GPUlayer's options may come before or after the script)",
                err=True,
            )
