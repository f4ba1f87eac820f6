"""`hpcrl plot`: one PNG of a run's ``metrics.jsonl``, for a person to look at.

Panels over a shared optimizer-step axis: reward (mean with a +-std band, and each reward
function's mean), what the reward functions logged with log_metric (only if they did), KL to the
reference model, completion length, where each step's time went
(generation, weight sync, training, waiting) and generated tokens per second. With many steps
the raw points are drawn faint under a smoothed line.

matplotlib (Agg backend) is imported only inside :func:`write_plot`: the rest of the login side
never pays for it, and never imports torch.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Optional

from hpcrl.job import metric_keys as mk
from hpcrl.job.errors import UserError
from hpcrl.job.rundir import METRICS_FILE, PLOT_FILE, check_output_path, read_metrics

__all__ = ["PLOT_FILE", "resolve_run_dir", "load_steps", "write_plot", "smooth", "window_for"]

SMOOTH_FROM = 30          # from this many steps on: faint raw points + a smoothed line
BARS_UP_TO = 60           # the step-time split as bars up to this many steps, as areas beyond

# One colour per meaning, the same in every plot (colour-blind safe, Okabe-Ito).
C_REWARD = "#1f3b73"
C_EVAL = "#c0392b"          # the eval split's reward (grpo.eval_strategy)
C_FUNCS = ("#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#999999")
C_KL = "#8e44ad"
C_LEN = "#0072B2"
C_TOK = "#2b7a4b"
PHASES = ((mk.TIME_GENERATION_S, "generation", "#56B4E9"), (mk.TIME_SYNC_S, "weight sync", "#E69F00"),
          (mk.TIME_TRAIN_S, "training", "#009E73"), (mk.TIME_WAIT_S, "waiting", "#BBBBBB"))


# ------------------------------------------------------------------------------ inputs
def resolve_run_dir(target: str) -> Path:
    """A run directory given directly, or the one of a registered job id."""
    path = Path(target).expanduser()
    if path.is_dir():
        return path
    if "/" not in target and not target.startswith("."):
        from hpcrl.login.registry import Registry, RegistryError
        try:
            with Registry() as registry:
                record = registry.get(target)
        except RegistryError as e:
            raise UserError(f"job registry: {e}") from None
        if record is not None:
            if not Path(record.run_dir).is_dir():
                raise UserError(f"job {target}: its run directory {record.run_dir} does not exist")
            return Path(record.run_dir)
    raise UserError(f"{target!r} is neither a run directory nor a registered job id (see `hpcrl status`)")


def _num(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def load_steps(run_dir: Path) -> list[dict]:
    """The step lines of metrics.jsonl, one per step (the last line of a step wins), in step order,
    with today's metric names (an older run's too: metric_keys.upgrade)."""
    by_step: dict[int, dict] = {}
    for rec in read_metrics(run_dir):
        if isinstance(rec, dict) and isinstance(rec.get(mk.STEP), int) and not isinstance(rec[mk.STEP], bool):
            by_step[rec[mk.STEP]] = rec
    return [mk.upgrade(by_step[s]) for s in sorted(by_step)]


def _job(run_dir: Path) -> dict:
    try:
        data = json.loads((run_dir / "job.json").read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def num_generations(run_dir: Path) -> int | None:
    """The run's grpo.num_generations, from its job.json (None when it cannot be read)."""
    n = _get(_job(Path(run_dir)), "recipe", "grpo", "num_generations")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _get(d: Any, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def reward_names(steps: list[dict]) -> list[str]:
    """Reward function names, in the order they first appear (TRL's ``rewards/<name>/mean``; an
    older run's ``rewards/<name>`` is read under it: steps as load_steps gives them)."""
    names: dict[str, None] = {}
    for rec in steps:
        for key in rec:
            name = mk.reward_of(key)
            if name is not None:
                names.setdefault(name, None)
    return list(names)


def logged_metric_names(steps: list[dict]) -> list[str]:
    """The metrics reward functions logged with TRL's log_metric (the trainer names them under
    "log_metric_names"), in the order they first appear."""
    names: dict[str, None] = {}
    for rec in steps:
        logged = rec.get(mk.LOG_METRIC_NAMES)
        for name in logged if isinstance(logged, list) else ():
            names.setdefault(str(name), None)
    return list(names)


def _reward_series(rec: dict, name: str) -> float:
    return _num(rec.get(mk.reward_mean(name)))


# ------------------------------------------------------------------------------ smoothing
def window_for(n: int) -> int:
    """Width of the moving average for n steps: about n/15, odd, 5..51."""
    w = max(5, min(51, n // 15))
    return w if w % 2 else w + 1


def smooth(values: list[float], window: int) -> list[float]:
    """Centred moving average that skips NaNs; at the ends it averages what there is (no lag mid-run)."""
    n, half = len(values), window // 2
    out = []
    for i in range(n):
        seg = [v for v in values[max(0, i - half):min(n, i + half + 1)] if not math.isnan(v)]
        out.append(sum(seg) / len(seg) if seg else math.nan)
    return out


# ------------------------------------------------------------------------------ the figure
def write_plot(run_dir: str | Path, output: Optional[str | Path] = None) -> Path:
    """Write the PNG (default ``<run_dir>/metrics.png``); returns its path.

    Raises UserError when there are no metrics yet or `output` cannot be written (checked before
    drawing), ImportError when matplotlib is missing.
    """
    run_dir = Path(run_dir)
    steps = load_steps(run_dir)
    if not steps:
        raise UserError(f"{run_dir}: no metrics yet (no step in {run_dir / METRICS_FILE})")
    out = check_output_path(str(output)) if output else run_dir / PLOT_FILE

    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    job = _job(run_dir)
    x = [rec[mk.STEP] for rec in steps]
    n = len(x)
    smoothed = n >= SMOOTH_FROM
    win = window_for(n)
    col = {k: [_num(rec.get(k)) for rec in steps] for k in
           (mk.REWARD, mk.REWARD_STD, mk.KL, mk.COMPLETIONS_MEAN_LENGTH, mk.TOKENS_PER_S, mk.TIME_STEP_S,
            *(p[0] for p in PHASES))}

    style = {"font.size": 10, "axes.titlesize": 11, "axes.titleweight": "bold", "axes.titlelocation": "left",
             "axes.labelsize": 10, "axes.labelcolor": "#333333", "xtick.labelsize": 9, "ytick.labelsize": 9,
             "xtick.color": "#444444", "ytick.color": "#444444", "legend.fontsize": 9, "legend.frameon": False,
             "axes.spines.top": False, "axes.spines.right": False, "axes.edgecolor": "#888888",
             "axes.grid": True, "grid.color": "#dddddd", "grid.linewidth": 0.7, "axes.axisbelow": True,
             "figure.facecolor": "white", "savefig.facecolor": "white"}
    with plt.rc_context(style):
        has_kl = any(not math.isnan(v) for v in col[mk.KL])
        logged = logged_metric_names(steps)
        has_tools = any(mk.TOOLS_CALL_FREQUENCY in rec for rec in steps)       # an agent's run
        # Trained off-policy (overlap_generation, max_staleness): how far behind, and what it cost.
        has_lag = any(_num(rec.get(mk.STALENESS_MAX)) > 0 or _num(rec.get(mk.OFF_POLICY_LAG)) > 0 for rec in steps)
        ratios = (1.7, *((1.1,) if logged else ()), *((0.9,) if has_tools else ()), *((0.9,) if has_lag else ()),
                  0.9 if has_kl else 0.28, 0.9, 1.1, 0.9)
        fig, (ax_r, *middle, ax_kl, ax_len, ax_t, ax_tok) = plt.subplots(
            len(ratios), 1, sharex=True,
            figsize=(11, (12.5 if has_kl else 11.4) + (1.8 if logged else 0) + (1.5 if has_tools else 0)
                     + (1.5 if has_lag else 0)), dpi=100,
            layout="constrained", height_ratios=ratios)
        ax_lag = middle[len(middle) - has_lag:]
        middle = middle[:len(middle) - has_lag]
        ax_logged, ax_tools = middle[:len(middle) - has_tools], middle[len(middle) - has_tools:]

        def line(ax, ys, color, label=None, lw=2.0, raw_too=True, z=3.0):
            """Raw points (faint when smoothed) and, with many steps, the moving average on top."""
            pts = [(a, b) for a, b in zip(x, ys) if not math.isnan(b)]
            if not pts:
                return False
            px, py = zip(*pts)
            if smoothed:
                if raw_too:
                    ax.plot(px, py, color=color, lw=0.8, alpha=0.28, zorder=z - 1)
                ax.plot(x, smooth(list(ys), win), color=color, lw=lw, label=label, zorder=z)
            else:
                ax.plot(px, py, color=color, lw=lw, label=label, zorder=z, marker="o", ms=4, mec="white", mew=0.8)
            return True

        def metric_lines(ax, keys_and_labels):
            """One line a metric, each in the next of the reward functions' colours."""
            for i, (key, label) in enumerate(keys_and_labels):
                line(ax, [_num(rec.get(key)) for rec in steps], C_FUNCS[i % len(C_FUNCS)], label=label, lw=1.6)

        # -- reward
        ax_r.set_title("Reward")
        rew, std = col[mk.REWARD], col[mk.REWARD_STD]
        if any(not math.isnan(v) for v in std):
            mid = smooth(rew, win) if smoothed else rew
            sd = smooth(std, win) if smoothed else std
            lo = [m - s if not math.isnan(s) else math.nan for m, s in zip(mid, sd)]
            hi = [m + s if not math.isnan(s) else math.nan for m, s in zip(mid, sd)]
            ax_r.fill_between(x, lo, hi, color=C_REWARD, alpha=0.12, lw=0, label="reward ± std", zorder=1)
        names = reward_names(steps)
        series = {name: [_reward_series(rec, name) for rec in steps] for name in names}
        if len(names) == 1 and all(math.isclose(a, b, abs_tol=1e-9) or (math.isnan(a) and math.isnan(b))
                                   for a, b in zip(series[names[0]], rew)):
            series = {}                          # the one function is the reward: one line, named so
            mean_label = f"reward (mean) = {names[0]}"
        else:
            mean_label = "reward (mean)"
        line(ax_r, rew, C_REWARD, label=mean_label, lw=2.4)
        for i, (name, ys) in enumerate(series.items()):
            line(ax_r, ys, C_FUNCS[i % len(C_FUNCS)], label=name, lw=1.4, raw_too=False, z=3.5)
        evals = [(rec[mk.STEP], _num(rec.get(mk.eval_key(mk.REWARD)))) for rec in steps]
        evals = [(s, v) for s, v in evals if not math.isnan(v)]
        if evals:                       # grpo.eval_strategy: the eval split's reward, never smoothed
            ax_r.plot(*zip(*evals), color=C_EVAL, lw=1.6, ls="--", marker="D", ms=5, mec="white", mew=0.8,
                      label="eval reward (eval split)", zorder=4)
        ax_r.set_ylabel("reward")
        handles, labels = ax_r.get_legend_handles_labels()
        order = sorted(range(len(labels)), key=lambda i: (labels[i] != mean_label, labels[i] != "reward ± std", i))
        if labels:
            ax_r.legend([handles[i] for i in order], [labels[i] for i in order], loc="best",
                        ncol=min(4, len(labels)))
        else:
            _note(ax_r, "no reward values logged")

        # -- the reward functions' own metrics
        for ax in ax_logged:
            ax.set_title("Logged by the reward functions (log_metric)")
            drawn = [line(ax, [_num(rec.get(name)) for rec in steps], C_FUNCS[i % len(C_FUNCS)], label=name, lw=1.6)
                     for i, name in enumerate(logged)]
            if any(drawn):
                ax.legend(loc="best", ncol=min(4, len(logged)))
            else:
                _note(ax, "no values logged")

        # -- an agent's tool use (TRL's tools/ metrics, hpcrl's turns per rollout)
        for ax in ax_tools:
            ax.set_title("Tool use")
            metric_lines(ax, [(mk.TOOLS_CALL_FREQUENCY, "calls per completion"),
                              (mk.TOOLS_FAILURE_FREQUENCY, "failed calls per call"),
                              (mk.TOOLS_TURNS_MEAN, "turns per rollout")])
            ax.set_ylim(bottom=0)
            ax.legend(loc="best", ncol=3)

        # -- off-policy: staleness (weight syncs behind), drops, and the sampler/trainer mismatch
        for ax in ax_lag:
            ax.set_title("Off-policy: completions behind the policy")
            metric_lines(ax, [(mk.STALENESS_MEAN, "staleness (syncs, mean)"),
                              (mk.STALENESS_MAX, "staleness (syncs, max)"),
                              (mk.DROPPED_STALE_TOTAL, "dropped as too stale (total)"),
                              (mk.UPDATED_IN_FLIGHT, "a sync landed inside (share)")])
            ax.set_ylim(bottom=0)
            ax.set_ylabel("syncs / completions")
            kl = [_num(rec.get(mk.SAMPLING_MISMATCH_KL)) for rec in steps]
            if any(not math.isnan(v) for v in kl):
                twin = ax.twinx()
                twin.grid(False)
                line(twin, kl, C_KL, label="mismatch KL (engine vs trainer)", lw=1.4, raw_too=False)
                twin.set_ylabel("mismatch KL")
                twin.legend(loc="lower right")
            ax.legend(loc="upper left", ncol=3)

        # -- KL
        ax_kl.set_title("KL to the reference model")
        beta = _get(job, "recipe", "grpo", "beta")
        if not line(ax_kl, col[mk.KL], C_KL, lw=1.8):
            why = "β = 0: no KL term, no reference model" if beta in (0, 0.0) else "no KL values logged"
            _note(ax_kl, why)
        else:
            ax_kl.set_ylabel("KL" + (f"  (β = {beta:g})" if isinstance(beta, (int, float)) else ""))

        # -- completion length
        ax_len.set_title("Completion length")
        if not line(ax_len, col[mk.COMPLETIONS_MEAN_LENGTH], C_LEN, lw=1.8):
            _note(ax_len, "no completion lengths logged")
        max_len = _get(job, "recipe", "grpo", "max_completion_length")
        if isinstance(max_len, (int, float)) and max_len > 0:
            ax_len.axhline(max_len, color="#999999", lw=1, ls="--", zorder=1)
            ax_len.annotate(f"max {max_len:g}", xy=(1, max_len), xycoords=("axes fraction", "data"),
                            xytext=(-4, 3), textcoords="offset points", ha="right", va="bottom",
                            color="#777777", fontsize=8.5)
            ax_len.set_ylim(bottom=0, top=max_len * 1.12)
        else:
            ax_len.set_ylim(bottom=0)
        ax_len.set_ylabel("tokens (mean)")

        # -- step time split
        ax_t.set_title("Where each step's time went")
        parts = [(label, color, [0.0 if math.isnan(v) else v for v in col[key]]) for key, label, color in PHASES
                 if any(not math.isnan(v) and v > 0 for v in col[key])]
        if parts:
            if n <= BARS_UP_TO:
                drawn = [p[2] for p in parts]
                bottom = [0.0] * n
                width = 0.8 if n < 2 else 0.8 * min(b - a for a, b in zip(x, x[1:]))
                for label, color, ys in parts:
                    ax_t.bar(x, ys, bottom=bottom, width=width, color=color, label=label, lw=0, zorder=2)
                    bottom = [b + y for b, y in zip(bottom, ys)]
            else:
                drawn = [smooth(p[2], win) if smoothed else p[2] for p in parts]
                ax_t.stackplot(x, *drawn, colors=[p[1] for p in parts], labels=[p[0] for p in parts],
                               lw=0, alpha=0.9, zorder=2)
            ax_t.legend(loc="upper left", ncol=len(parts), handlelength=1.2, columnspacing=1.2)
            # The scale of what is drawn: a smoothed stack under an axis sized for a raw spike
            # (the first step's engine warm-up) would be a thin strip at the bottom.
            top = max(sum(vals) for vals in zip(*drawn))
            ax_t.set_ylim(0, top * 1.28 if top > 0 else 1)
        else:
            _note(ax_t, "no step times logged")
        ax_t.set_ylabel("seconds")

        # -- tokens/s
        ax_tok.set_title("Generated tokens per second")
        if not line(ax_tok, col[mk.TOKENS_PER_S], C_TOK, lw=1.8):
            _note(ax_tok, "no tokens/s logged")
        ax_tok.set_ylim(bottom=0)
        ax_tok.set_ylabel("tokens/s")

        if n <= 16:
            ax_tok.set_xticks(x)                 # every step, no fractions
        else:
            ax_tok.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=12))
        ax_tok.set_xlabel("optimizer step")
        lo_x, hi_x = min(x), max(x)
        gap = min((b - a for a, b in zip(x, x[1:])), default=1)
        pad = 0.6 * gap if n <= BARS_UP_TO else 0.01 * (hi_x - lo_x)
        ax_tok.set_xlim(lo_x - pad, hi_x + pad)
        if smoothed:
            ax_r.annotate(f"lines: moving average over {win} steps; faint: each step",
                          xy=(1, 1), xycoords="axes fraction", xytext=(0, 4), textcoords="offset points",
                          ha="right", va="bottom", fontsize=8.5, color="#777777")

        fig.suptitle(_title(run_dir, job), x=0.01, ha="left", fontsize=14, fontweight="bold")
        fig.text(0.99, 0.995, _subtitle(run_dir, job, steps), ha="right", va="top", fontsize=9, color="#555555")
        fig.savefig(out, format="png")
        plt.close(fig)
    return out


def _note(ax, text: str) -> None:
    """A panel with nothing to draw says why, quietly."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="#777777",
            fontsize=11, style="italic")
    ax.tick_params(axis="y", left=False, labelleft=False)
    ax.grid(False)


def _title(run_dir: Path, job: dict) -> str:
    name = _get(job, "recipe", "name") or run_dir.name
    site = _get(job, "site", "name")
    nodes = _get(job, "recipe", "resources", "nodes")
    where = ", ".join(p for p in (f"on {site}" if site else "",
                                  f"{nodes} node{'s' if nodes != 1 else ''}" if isinstance(nodes, int) else "") if p)
    return f"{name}  ·  {where}" if where else str(name)


def _subtitle(run_dir: Path, job: dict, steps: list[dict]) -> str:
    bits = []
    model = _get(job, "recipe", "model", "path")
    if model:
        bits.append(f"model {model}")
    max_steps = steps[-1].get(mk.MAX_STEPS, _get(job, "recipe", "grpo", "max_steps"))
    last = steps[-1][mk.STEP]
    bits.append(f"step {last} of {max_steps}" if isinstance(max_steps, int) and max_steps > 0 else f"{len(steps)} steps")
    t1 = _num(steps[-1].get(mk.TIME))
    if not math.isnan(t1):
        bits.append(time.strftime("%Y-%m-%d %H:%M", time.localtime(t1)))
    bits.append(run_dir.resolve().name)
    return "   ·   ".join(bits)
