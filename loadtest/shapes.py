"""Load shapes as locust ``LoadTestShape`` classes: steady, step, spike and soak.

Each class follows the plan of :func:`loadtest.plan.build_stages` (stages, their users,
spawn rates, settle windows and SLO flags; see that module for what each shape does).
Import this module only inside locust: importing locust monkey-patches the process.

Example (a locustfile)::

    from loadtest import plan, shapes
    shape = shapes.StepShape(plan.ShapeConfig("step", 60, (1, 2, 4, 8)))
"""
from __future__ import annotations

from typing import ClassVar

from locust import LoadTestShape

from loadtest.plan import (
    ShapeConfig,
    Stage,
    build_stages,
    parse_duration,
    parse_users,
    stage_at,
    tick_at,
)
from serve.errors import ConfigError

__all__ = ["PlannedShape", "SoakShape", "SpikeShape", "SteadyShape", "StepShape", "shape_class"]


class PlannedShape(LoadTestShape):
    """A ``LoadTestShape`` that follows :func:`build_stages`.

    Built with a :class:`ShapeConfig`, or without one (as locust builds shapes it finds
    in a locustfile), in which case the config is read on the first tick from the
    ``--dlrm-*`` options that ``loadtest/locustfile.py`` registers.
    """

    abstract: ClassVar[bool] = True
    shape_name: ClassVar[str] = ""

    def __init__(self, config: ShapeConfig | None = None) -> None:
        super().__init__()
        if config is not None and config.shape != self.shape_name:
            raise ConfigError(f"{type(self).__name__} got a config for shape {config.shape!r}")
        self._config = config
        self._stages: list[Stage] | None = None

    @property
    def config(self) -> ShapeConfig:
        if self._config is None:
            opts = self.runner.environment.parsed_options if self.runner else None
            if opts is None:
                raise ConfigError(f"{type(self).__name__} has no config: pass a ShapeConfig "
                                  "or run it from loadtest/locustfile.py")
            self._config = ShapeConfig(self.shape_name, parse_duration(opts.dlrm_duration),
                                       parse_users(opts.dlrm_users))
        return self._config

    @property
    def stages(self) -> list[Stage]:
        if self._stages is None:
            self._stages = build_stages(self.config)
        return self._stages

    def stage_at(self, t: float) -> Stage | None:
        """The stage running at ``t`` seconds, None once the shape is over."""
        return stage_at(self.stages, t)

    def tick_at(self, t: float) -> tuple[int, float] | None:
        return tick_at(self.stages, t)

    def tick(self) -> tuple[int, float] | None:
        return self.tick_at(self.get_run_time())


class SteadyShape(PlannedShape):
    shape_name = "steady"


class StepShape(PlannedShape):
    shape_name = "step"


class SpikeShape(PlannedShape):
    shape_name = "spike"


class SoakShape(PlannedShape):
    shape_name = "soak"


_CLASSES: dict[str, type[PlannedShape]] = {
    c.shape_name: c for c in (SteadyShape, StepShape, SpikeShape, SoakShape)}


def shape_class(name: str) -> type[PlannedShape]:
    """The shape class named ``name`` (one of SHAPES)."""
    if name not in _CLASSES:
        raise ConfigError(f"shape {name!r} is unknown; choose one of {', '.join(_CLASSES)} "
                          "(--shape or env LOAD_SHAPE)")
    return _CLASSES[name]
