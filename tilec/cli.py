"""The ``tilec`` command line: thin click commands that build a config and call the library."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from tilec.config import (
    CompileConfig,
    parse_autocast,
    parse_bytes,
    parse_grid,
    parse_inputs,
    parse_name,
    parse_names,
    parse_segments,
)
from tilec.errors import TilecError
from tilec.ir import FLOAT_DTYPES, MAX_COUNT
from tilec.pipeline import compile_model
from tilec.planio import load
from tilec.report import describe_input, describe_plan, node_table, same_segments, tile_table


class Refusal(click.ClickException):
    """A bad input: one line on standard error, exit code 2."""

    exit_code = 2


@contextmanager
def refusals():
    """A command's call into the library: a ``TilecError`` becomes a one-line refusal (exit code 2),
    and each warning one line on standard error."""
    with warnings.catch_warnings():
        warnings.showwarning = _warning_line
        try:
            yield
        except TilecError as error:
            raise Refusal(" ".join(str(error).split())) from None


@contextmanager
def _usage_in_one_line():
    """click's own usage errors (a bad flag value, an unknown option, a missing argument) as one
    line naming the command's help, exit code 2; asking for help by giving no command stays."""
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:
        raise
    except click.UsageError as error:
        where = f" (see '{error.ctx.command_path} --help')" if error.ctx is not None else ""
        raise Refusal(" ".join(error.format_message().split()).rstrip(".") + where) from None


class Commands(click.Group):
    """tilec's command group: its usage errors, and its commands', are one line (``Refusal``)."""

    def make_context(self, *args, **kwargs):
        with _usage_in_one_line():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _usage_in_one_line():
            return super().invoke(ctx)


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    click.echo(f"{category.__name__}: {' '.join(str(message).split())}", err=True)


@contextmanager
def planning_progress():
    """A ``progress(done, total)`` callback drawing a bar on a terminal's stderr, else ``None``."""
    console = Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("planning tiles"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("plan", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _console() -> Console:
    return Console(width=None if Console().is_terminal else 200, highlight=False)


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tilec")
def main() -> None:
    """tilec: compile a PyTorch CNN into exact tile-by-tile training code."""


@main.command("compile")
@click.argument("model_file", type=click.Path(path_type=Path))
@click.option("--attr", default="model", show_default=True, help="Model attribute (or function) in MODEL_FILE.")
@click.option("--input", "inputs", multiple=True, help="One input SHAPE[:DTYPE], e.g. 1,3,8192,8192:uint8; once "
              "per tensor argument of forward, in order (default: the file's INPUTS or INPUT_SHAPE).")
@click.option("--input-shape", help="Shorthand for one input N,C,H,W in the model's dtype.")
@click.option("--grid", help="Tile grid ROWSxCOLS over the output, e.g. 4x4 (1x1: untiled).")
@click.option("--segments", help="Explicit segments FIRST:STOP@ROWSxCOLS[/BATCH][:tiled],... over half-open node "
              "ranges (positions as `tilec inspect PLAN --nodes` lists them; ROWSxCOLSpx: tiles that many input "
              "pixels long, the last taking the rest; /BATCH: tiles per call; 1x1 = stored, untiled, unless :tiled). "
              "`tilec inspect` prints a plan's so.")
@click.option("--memory-budget", help="Choose segments and grids to fit this many bytes, e.g. 160MiB, 1.5GB "
              "(recomputing long-lived tensors where that is faster than keeping them).")
@click.option("--like", type=click.Path(path_type=Path), help="A plan PLAN.json of the same model at another input "
              "size: its segments, in input pixels, planned at this size (with --memory-budget, a search narrowed "
              "to their cuts, which merges, moves or stores them; the whole search where no plan there fits).")
@click.option("--batch", type=click.IntRange(min=1, max=MAX_COUNT),
              help="With --grid or --segments: run up to N consecutive tiles of one shape class as one call, "
              "stacked along the batch axis (where a segment's tiles can; --memory-budget chooses it itself).")
@click.option("--recompute", help="Nodes NAME,... whose late readers recompute them from the input instead of "
              "keeping them (names as `tilec inspect PLAN --nodes` lists them; --segments then counts the copies).")
@click.option("--ranks", type=click.IntRange(min=1, max=MAX_COUNT),
              help="Plan for N ranks of a process group sharing each tiled segment's tiles "
              "(TiledModel(model, process_group=...)): records each rank's tiles.")
@click.option("--dtype", type=click.Choice(FLOAT_DTYPES), default="float32",
              show_default=True, help="Training dtype the memory prediction assumes.")
@click.option("--autocast", help="DEVICE:DTYPE of the torch.autocast the step runs under (e.g. cuda:float16, "
              "cpu:bfloat16): the memory prediction and budget take each op in the dtype autocast picks.")
@click.option("--name", help="Plan and module name (default: the file's stem).")
@click.option("--out-dir", type=click.Path(path_type=Path), default=Path("."), show_default=True,
              help="Where NAME_tiled.py is written.")
@click.option("--plan-dir", type=click.Path(path_type=Path), default=Path("plans"), show_default=True,
              help="Where NAME.plan.json is written.")
@click.option("--tissue-mask", type=click.Path(path_type=Path), help="A .npy 2-D boolean mask over the first "
              "image input (True: tissue), outside which the input is one colour (a slide masked with it): the "
              "estimate and --memory-budget count the background tiles computed once.")
def compile_command(model_file, attr, inputs, input_shape, grid, segments, memory_budget, like, batch, recompute,
                    ranks, dtype, autocast, name, out_dir, plan_dir, tissue_mask) -> None:
    """Compile MODEL_FILE into a plan and a generated tiled-training module."""
    with refusals():
        config = CompileConfig(
            model_path=model_file,
            attr=attr,
            inputs=parse_inputs(inputs, input_shape),
            grid=parse_grid(grid) if grid is not None else None,
            segments=parse_segments(segments) if segments is not None else None,
            memory_budget=parse_bytes(memory_budget) if memory_budget is not None else None,
            like=like,
            batch=batch,
            recompute=parse_names(recompute) if recompute is not None else (),
            ranks=ranks,
            dtype=dtype,
            autocast=parse_autocast(autocast) if autocast is not None else None,
            name=parse_name(name) if name is not None else None,
            out_dir=out_dir,
            plan_dir=plan_dir,
            tissue_mask=tissue_mask,
        )
        with planning_progress() as progress:
            result = compile_model(config, progress=progress)
    console = _console()
    for one in (result.plan, result.plan.other):
        if one is not None:
            console.print(describe_plan(one))
    console.print(same_segments(result.plan), soft_wrap=True)
    console.print(f"wrote {result.plan_path} and {result.module_path}")


@main.command("inspect")
@click.argument("plan_file", type=click.Path(path_type=Path))
@click.option("--tile", help="Tile coordinate I,J (grid row, grid column) to show per node.")
@click.option("--node", help="Only this node (a name from --nodes).")
@click.option("--segment", type=int, help="Segment index for --tile (default: every tiled segment).")
@click.option("--nodes", "list_nodes", is_flag=True, help="List every node: position, op, module, shape, segment.")
def inspect_command(plan_file, tile, node, segment, list_nodes) -> None:
    """Show a plan: its segments, its nodes, or one tile's regions, halos and padding per node."""
    with refusals():
        plan = load(plan_file)
        coordinate = parse_tile(tile) if tile is not None else None
        # Build every table first, so a refusal prints its one line and nothing else.
        wanted = coordinate is not None or node is not None
        tables = tile_table(plan, coordinate, node, segment) if wanted else []
        if list_nodes:
            tables.insert(0, node_table(plan))
    console = _console()
    for one in (plan, plan.other):
        if one is not None:
            console.print(describe_plan(one))
    console.print(same_segments(plan), soft_wrap=True)
    for table in tables:
        console.print(table)


@main.command("verify")
@click.argument("model_file", type=click.Path(path_type=Path))
@click.option("--attr", default="model", show_default=True, help="Model attribute (or function) in MODEL_FILE.")
@click.option("--input", "inputs", multiple=True, help="One input SHAPE[:DTYPE], once per tensor argument of "
              "forward (default: the file's INPUTS or INPUT_SHAPE; smaller is faster).")
@click.option("--input-shape", help="Shorthand for one input N,C,H,W in the model's dtype.")
@click.option("--grid", help="Tile grid ROWSxCOLS (default: 2x2, clipped to the output size).")
@click.option("--seed", type=click.IntRange(min=0, max=2**63 - 1), default=0, show_default=True,
              help="Seed of the random input and gradient.")
@click.option("--tolerance", type=float, default=1e-10, show_default=True, help="Largest error still called exact.")
@click.option("--device", default="cpu", show_default=True, help="Torch device to run both steps on.")
def verify_command(model_file, attr, inputs, input_shape, grid, seed, tolerance, device) -> None:
    """Check that tiled training of MODEL_FILE equals untiled training, in float64.

    Compiles into a temporary folder, runs one tiled and one untiled forward and backward
    step on the same random data, and prints the max error per tensor. Exit code 0: exact;
    1: a tensor differs by more than --tolerance; 2: bad input.
    """
    from tilec.verify import verify

    with refusals():
        verdict = verify(
            model_file,
            attr=attr,
            inputs=parse_inputs(inputs, input_shape),
            grid=parse_grid(grid) if grid is not None else None,
            seed=seed,
            tolerance=tolerance,
            device=device,
        )
    console = _console()
    shape = ", ".join(describe_input(spec) for spec in verdict.plan.inputs)
    console.print(f"verify {model_file}: inputs {shape}, grid {verdict.grid[0]}x{verdict.grid[1]}, float64, "
                  f"seed {seed}")
    table = Table()
    for column in ("tensor", "shape", "max abs error", "status"):
        table.add_column(column, justify="left" if column == "tensor" else "right")
    for check in verdict.checks:
        ok = check.error <= verdict.tolerance
        table.add_row(check.name, "x".join(map(str, check.shape)) or "scalar", f"{check.error:.3e}",
                      "ok" if ok else "MISMATCH")
    console.print(table)
    if verdict.exact:
        console.print(f"exact: every error <= {verdict.tolerance:g}")
    else:
        bad = sum(not check.error <= verdict.tolerance for check in verdict.checks)
        console.print(f"MISMATCH: {bad} tensor(s) differ by more than {verdict.tolerance:g}")
        click.get_current_context().exit(1)


@main.command("viz")
@click.argument("plan_file", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True,
              help="Picture to write: .png, .svg or .pdf.")
@click.option("--node", help="Node whose input is drawn (default: the first node of the first tiled segment).")
@click.option("--tile", help="Tile I,J to draw (default: the middle tile of the node's segment).")
def viz_command(plan_file, output, node, tile) -> None:
    """Draw one tile's share, halo, input slice and padding at a node, and its cone through the graph."""
    from tilec.viz import save

    with refusals():
        plan = load(plan_file)
        save(plan, output, node, parse_tile(tile) if tile is not None else None)
    _console().print(f"wrote {output}")


def parse_tile(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
        raise TilecError(f"--tile must be I,J (two non-negative integers), got {text!r}")
    return int(parts[0]), int(parts[1])
