"""Environments: a domain in one value (`Environment`), its verdicts (`Verdict`), and the
built-in ones, a module each: code, math, files (task files and generated tasks), terminal
(task containers), cad (CadQuery parts measured in the sandbox), charts (report pages as
images, numeric answers); `synthetic` holds the quickstart's generated tasks, `hidden_format` code tasks whose format only the feedback states and `adaptive` the mixture's optional adaptive sampler. A config
names each environment by import path (`load`). docs/environments.md walks through writing one."""

from ptrain.envs.base import (Context, Environment, Splits, Tool, TurnPolicy, load,  # noqa: F401
                              load_all)
from ptrain.envs.verdict import Verdict, rubric  # noqa: F401
