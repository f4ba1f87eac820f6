"""The `hpcrl` command. Login-side: imports nothing heavy at module level, never torch/vllm/mpi4py.

Every user mistake ends as one line on stderr and exit status 2, with nothing written or submitted.
main() is the one place where errors become exit statuses; each command's module
(hpcrl.login.commands.<name>) is imported only when that command runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hpcrl.job.errors import UserError

EXIT_USER = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (not usage + error) and exit status 2."""

    def error(self, message: str):
        command = self.prog.split(" ", 1)[1] if " " in self.prog else ""     # "hpcrl submit" -> "submit"
        raise UserError(f"{command}: {message}" if command else message)


def _add_job_args(p: argparse.ArgumentParser, site_default: str | None) -> None:
    p.add_argument("recipe", nargs="?", help="recipe YAML (default: the built-in demo)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override recipe fields, e.g. grpo.beta=0.04")
    p.add_argument("--site", "-s", default=site_default, help="site profile (see `hpcrl sites`)")
    p.add_argument("-N", "--nodes", type=int, help="number of nodes")
    p.add_argument("-t", "--time", help="time limit (Slurm format, e.g. 01:30:00)")
    p.add_argument("-A", "--account", help="project account")
    p.add_argument("-p", "--partition", help="partition")
    p.add_argument("-q", "--qos", help="quality of service")
    p.add_argument("-J", "--job-name", dest="name", help="job name")
    p.add_argument("--run-dir", help="run directory (default: <site runs_dir>/<name>-<time>)")


def _run_args(p: argparse.ArgumentParser) -> None:
    _add_job_args(p, "local")
    p.add_argument("--dry-run", action="store_true", help="print the launch command and stop")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="run a run directory of `hpcrl run` again; it continues from its last checkpoint")


def _render_args(p: argparse.ArgumentParser) -> None:
    _add_job_args(p, None)
    p.add_argument("-o", "--output", help="also write the script to this file")


def _submit_args(p: argparse.ArgumentParser) -> None:
    _render_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="submit an existing run directory again; it continues from its last checkpoint")


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", help="recipe YAML (default: the built-in demo)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override recipe fields, e.g. grpo.beta=0.04")
    p.add_argument("--site", "-s", help="site profile (see `hpcrl sites`)")
    p.add_argument("-N", "--nodes", type=int, help="number of nodes")
    p.add_argument("-t", "--time", help="time limit (checked against the partition's limits)")
    p.add_argument("-A", "--account", help="project account")
    p.add_argument("-p", "--partition", help="partition")
    p.add_argument("-q", "--qos", help="quality of service")
    p.add_argument("--server-gpus", type=int, help="GPUs per node for the inference server (= inference.gpus)")
    p.add_argument("--json", action="store_true")


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", help="recipe or `trl grpo --config` YAML (default: the built-in demo)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override fields, e.g. grpo.beta=0.04 or beta=0.04")
    p.add_argument("--json", action="store_true")


def _status_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id", nargs="?")
    p.add_argument("--json", action="store_true")
    p.add_argument("-n", "--limit", type=int, default=50, help="show at most this many jobs")


def _logs_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id")
    p.add_argument("-f", "--follow", action="store_true")


def _cancel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id")
    p.add_argument("--now", action="store_true", help="scancel at once, without the trainers' checkpoint")


def _plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="JOBID_OR_RUN_DIR", help="a registered job id, or a run directory")
    p.add_argument("-o", "--output", help="the PNG to write (default: <run_dir>/metrics.png)")


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    p.add_argument("-o", "--output", metavar="DIR",
                   help="where the model goes (default: <run_dir>/model/checkpoint-<step>)")


def _sites_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?")


COMMANDS = {  # name: (its line in `hpcrl --help`, what adds its arguments); each runs hpcrl.login.commands.<name>
    "run": ("run a recipe on this machine (no Slurm): the embedded default", _run_args),
    "render": ("write the run directory and a standalone sbatch script", _render_args),
    "submit": ("render, submit with sbatch, and register the job", _submit_args),
    "plan": ("the placement a job gets, one row per task, and whether it fits in memory", _plan_args),
    "recipe": ("print the recipe a file (hpcrl's or TRL's) and key=value overrides resolve to", _recipe_args),
    "status": ("registered jobs, or one job in detail", _status_args),
    "logs": ("print (or follow) a job's log", _logs_args),
    "cancel": ("cancel a job (a running one checkpoints first)", _cancel_args),
    "plot": ("plot a run's metrics (reward, KL, lengths, step time) to a PNG", _plot_args),
    "export": ("write a Hugging Face model directory from a run's training checkpoint", _export_args),
    "sites": ("list site profiles, or show one resolved", _sites_args),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (`command`) one that knows that command only: `hpcrl render` starts a
    few ms sooner without argparse's setup of the other ten and their ~65 arguments (every help
    string goes through gettext, which looks for a catalogue on disk each time)."""
    parser = _Parser(prog="hpcrl", description="GRPO fine-tuning of LLMs on Slurm supercomputers.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (text, add_arguments) in COMMANDS.items():
        if command in (None, name):
            add_arguments(sub.add_parser(name, help=text))
    return parser


def _version() -> str:
    from hpcrl import __version__
    return f"hpcrl {__version__}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            # argparse takes positionals in one run: in `recipe.yaml -N 2 grpo.beta=0` the
            # override after the option is left over; it is still an override.
            if hasattr(args, "overrides") and not any(x.startswith("-") for x in extra):
                args.overrides.extend(extra)
            else:
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command is None:
            parser.print_help()
            return 0
        command = importlib.import_module(f"hpcrl.login.commands.{args.command}")
        return command.main(args) or 0
    except UserError as e:
        print(f"hpcrl: error: {e}", file=sys.stderr)
        return EXIT_USER
    except OSError as e:
        # A file system or tool problem, not a bug: say which file, no traceback.
        print(f"hpcrl: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hpcrl: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # A SlurmError can only come from a command that imported slurm; looking it up in
        # sys.modules keeps `hpcrl --help` from importing it.
        slurm = sys.modules.get("hpcrl.login.slurm")
        if slurm is None or not isinstance(e, slurm.SlurmError):
            raise
        # Slurm not answering is the site's trouble (1); Slurm refusing the job is the user's (2).
        text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"hpcrl: error: {text}", file=sys.stderr)
        return 1 if isinstance(e, slurm.SlurmUnavailable) else EXIT_USER
