"""The ``dspark`` command line (same as ``python -m dspark``).

:mod:`dspark.cli.core` holds the command registry, the options every command shares (``-v`` /
``-q``, ``--json``), logging and the mapping of errors onto exit codes; each command group
registers its commands from its own module, imported here in the order ``dspark --help`` lists
them: :mod:`~dspark.cli.plugins`; :mod:`~dspark.cli.run` (``demo``, ``generate``);
:mod:`~dspark.cli.train` (``data``, ``train``, ``calibrate``); :mod:`~dspark.cli.measure`
(``eval``, ``profile``, ``bench``); :mod:`~dspark.cli.interop` (``interop``, ``convert``, ``serve``,
``export-target``, ``export``).

``data``, ``train``, ``calibrate``, ``eval``, ``bench`` and ``demo`` are typed library functions
(:func:`dspark.build_data`, :func:`dspark.train`, :func:`dspark.calibrate`, :func:`dspark.evaluate`,
:func:`dspark.run_bench`, :func:`dspark.run_demo`) whose options classes declare the commands'
options (:mod:`dspark.options`); their handlers only build the options from the parsed arguments,
call the function and print the result.
"""

from __future__ import annotations

# Each module registers its commands; this order is the order `dspark --help` lists them.
# isort: off
from dspark.cli import plugins, run, train, measure, interop  # noqa: F401
# isort: on
from dspark.cli.core import COMMANDS, SUMMARIES, build_parser, main

__all__ = ["COMMANDS", "SUMMARIES", "build_parser", "main"]
