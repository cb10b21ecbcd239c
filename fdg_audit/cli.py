"""``python -m fdg_audit scenario|attack|report|plugins``. User errors print as one line, exit code 2; SIGTERM
stops as Ctrl-C does (workers stopped, every finished file and attack job kept)."""
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import List

from argparse_dataclass import ArgumentParser

from .errors import UserError


@dataclass
class ScenarioArgs:
    file: str = field(metadata=dict(args=["file"], help="scenario TOML, e.g. scenarios/quick.toml"))
    set: List[str] = field(default_factory=list, metadata=dict(
        args=["--set"], nargs="*", type=str, action="extend", help="overrides key=value, e.g. train.rounds=3"))
    out: str = field(default="", metadata=dict(help="output root (default: the scenario's `out`, runs/)"))
    quiet: bool = field(default=False, metadata=dict(help="no progress bars"))
    resume: str = field(default="", metadata=dict(help="an interrupted run folder: skip its finished runs, run the rest"))
    yes: bool = field(default=False, metadata=dict(help="run even when the attacks' estimate is over attack_budget_s"))
    preview: bool = field(default=False, metadata=dict(
        help="a first answer: one seed of every data set, the same methods and attacks (n = 1: no test)"))


@dataclass
class AttackArgs:
    run_dir: str = field(metadata=dict(args=["run_dir"], help="a finished run folder"))
    attacks: List[str] = field(default_factory=list, metadata=dict(
        nargs="*", type=str, help="attack names (default: the scenario's [[attacks]], else every attack)"))
    quiet: bool = field(default=False, metadata=dict(help="no progress bars"))
    trust_plugins: bool = field(default=False, metadata=dict(
        help="import module:Class plugins the run folder names (only for folders you trust)"))
    in_process: bool = field(default=False, metadata=dict(
        help="run attacks inside this process (debugging: the view boundary is not enforced)"))
    resume: bool = field(default=False, metadata=dict(
        help="go on with an interrupted attack: keep the jobs it finished (same settings), run the rest"))


@dataclass
class ReportArgs:
    run_dirs: List[str] = field(metadata=dict(args=["run_dirs"], nargs="+", type=str, help="run folders"))
    out: str = field(default="", metadata=dict(help="report folder (default: the first run folder)"))


USAGE = """usage: python -m fdg_audit COMMAND ...
  scenario FILE [--set key=value ...] [--resume RUN_DIR] [--preview] [--yes]
                                        run a scenario (train, record, attack, report), or finish one
  attack RUN_DIR [--attacks NAME ...] [--trust-plugins] [--in-process] [--resume]
                                        re-run attacks on a finished run folder (--resume: go on with an
                                        interrupted one, its finished jobs kept)
  report RUN_DIR [RUN_DIR ...]          aggregate run folders into report.md + plots
  answer REPORT_DIR                     print a report's page one as markdown (the README's answer)
  plugins                               list methods and attacks and where they come from
  new-method NAME | new-attack NAME     write a plugin package to start from (entry point and test)"""


def _fold(argv: list[str], flag: str) -> list[str]:
    """argparse-dataclass drops ``action="extend"``: turn ``flag a flag b`` into ``flag a b`` so no value is lost."""
    if argv.count(flag) < 2:
        return argv
    rest, values, i = [], [], 0
    while i < len(argv):
        if argv[i] == flag:
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                values.append(argv[i])
                i += 1
        else:
            rest.append(argv[i])
            i += 1
    return rest + [flag] + values


def describe() -> str:
    """A table of every registered method and attack and where it comes from (``plugins``)."""
    from .attack import load_attack
    from .plugins import GROUPS, available, origin
    from .protocol import load_method
    lines = []
    for kind in ("method", "attack"):
        lines.append(f"{kind}s ({GROUPS[kind]}):")
        for name, path in sorted(available(kind).items()):
            try:
                obj = load_method(name) if kind == "method" else load_attack(name)
                extra = (f"sends {', '.join(obj.kinds)}" if kind == "method" else
                         f"{obj.adversary} reads {', '.join(obj.consumes)}")
            except UserError as e:
                extra = f"BROKEN: {e}"
            lines.append(f"  {name:<26} {path:<36} [{origin(kind, name)}] {extra}")
    return "\n".join(lines)


def _terminated(signum, frame):
    raise KeyboardInterrupt   # SIGTERM: the same clean stop as Ctrl-C


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        return _main(argv)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old)


def _main(argv: list) -> int:
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "scenario":
            a = ArgumentParser(ScenarioArgs, prog="fdg_audit scenario").parse_args(_fold(rest, "--set"))
            from .runner import run_scenario
            from .report import headline
            root = run_scenario(a.file, a.set, a.out or None, a.quiet, a.resume or None, preview=a.preview, yes=a.yes)
            print(headline(root))
            print(f"results: {root}")
            if a.preview:
                print(f"this was a preview (one seed per data set: no interval across runs, no test); the full job: "
                      f"python -m fdg_audit scenario {a.file}")
        elif cmd == "attack":
            a = ArgumentParser(AttackArgs, prog="fdg_audit attack").parse_args(rest)
            from .runner import run_attacks_cli
            print(run_attacks_cli(a.run_dir, a.attacks, a.quiet, a.trust_plugins, not a.in_process, a.resume))
        elif cmd == "report":
            a = ArgumentParser(ReportArgs, prog="fdg_audit report").parse_args(rest)
            from .report import write_report
            print(f"report: {write_report(a.run_dirs, a.out or a.run_dirs[0])}")
        elif cmd == "answer":
            from .report.pageone import answer_md
            if len(rest) != 1:
                raise UserError("answer takes one report folder, e.g. python -m fdg_audit answer docs/example-report")
            print(answer_md(rest[0]))
        elif cmd == "plugins":
            print(describe())
        elif cmd in ("new-method", "new-attack"):
            from .skeleton import new_plugin
            if len(rest) != 1:
                raise UserError(f"{cmd} takes one NAME, e.g. python -m fdg_audit {cmd} my_{cmd[4:]}")
            root = new_plugin(cmd[4:], rest[0])
            print(f"wrote {root}/: pip install -e {root} && python -m pytest {root}/tests "
                  f"({'methods' if cmd == 'new-method' else 'attacks'}/README.md is the how-to)")
        else:
            print(f"unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
            return 2
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        import signal
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C while workers are stopped adds nothing
        print("error: interrupted; every file written so far is complete (outputs are written atomically)"
              + ("; the finished attack jobs are kept: add --resume to go on" if cmd == "attack" else ""),
              file=sys.stderr)
        return 2
    except RecursionError:
        print("error: an input nests too deeply (a damaged or hostile JSON or TOML file): check the files given",
              file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
