"""The ``tilec`` command line: thin click commands that build a config and call the library."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import click
from rich.console import Console

from tilec.config import CompileConfig, parse_grid, parse_shape
from tilec.errors import TilecError
from tilec.pipeline import compile_model
from tilec.planio import load
from tilec.report import describe_plan, tile_table


class Refusal(click.ClickException):
    """A bad input: one line on standard error, exit code 2."""

    exit_code = 2


@contextmanager
def refusals():
    try:
        yield
    except TilecError as error:
        raise Refusal(str(error)) from None


def _console() -> Console:
    return Console(width=None if Console().is_terminal else 200, highlight=False)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tilec")
def main() -> None:
    """tilec: compile an nn.Sequential into exact tile-by-tile training code."""


@main.command("compile")
@click.argument("model_file", type=click.Path(path_type=Path))
@click.option("--attr", default="model", show_default=True, help="Model attribute (or function) in MODEL_FILE.")
@click.option("--input-shape", help="Input shape N,C,H,W (default: the file's INPUT_SHAPE).")
@click.option("--grid", help="Tile grid ROWSxCOLS over the output, e.g. 4x4.")
@click.option("--name", help="Plan and module name (default: the file's stem).")
@click.option("--out-dir", type=click.Path(path_type=Path), default=Path("."), show_default=True,
              help="Where NAME_tiled.py is written.")
@click.option("--plan-dir", type=click.Path(path_type=Path), default=Path("plans"), show_default=True,
              help="Where NAME.plan.json is written.")
def compile_command(model_file, attr, input_shape, grid, name, out_dir, plan_dir) -> None:
    """Compile MODEL_FILE into a plan and a generated tiled-training module."""
    with refusals():
        config = CompileConfig(
            model_path=model_file,
            attr=attr,
            input_shape=parse_shape(input_shape) if input_shape else None,
            grid=parse_grid(grid) if grid else None,
            name=name,
            out_dir=out_dir,
            plan_dir=plan_dir,
        )
        result = compile_model(config)
    console = _console()
    console.print(describe_plan(result.plan))
    console.print(f"wrote {result.plan_path} and {result.module_path}")


@main.command("inspect")
@click.argument("plan_file", type=click.Path(path_type=Path))
@click.option("--tile", help="Tile coordinate I,J (grid row, grid column) to show per layer.")
@click.option("--layer", type=int, help="Only this layer index.")
@click.option("--segment", type=int, help="Segment index for --tile (default: every segment).")
def inspect_command(plan_file, tile, layer, segment) -> None:
    """Show a plan: its segments, or one tile's regions, halos and padding per layer."""
    with refusals():
        plan = load(plan_file)
        coordinate = parse_tile(tile) if tile else None
        # Build every table first, so a refusal prints its one line and nothing else.
        tables = tile_table(plan, coordinate, layer, segment) if coordinate is not None or layer is not None else []
    console = _console()
    console.print(describe_plan(plan))
    for table in tables:
        console.print(table)


def parse_tile(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
        raise TilecError(f"--tile must be I,J (two non-negative integers), got {text!r}")
    return int(parts[0]), int(parts[1])
