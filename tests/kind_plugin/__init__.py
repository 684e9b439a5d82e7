"""A third party's drafter kind, as a plugin package would ship it: one folder holding the kind
object (:mod:`.kind`), its module and graphs (:mod:`.model`), and the hook lines that register it
through the plugin manager — the same hooks dspark's built-in kinds use (tests/test_kind_plugin.py)."""

from dspark.builtins import neural_drafter_factory
from dspark.hookspecs import hookimpl
from kind_plugin.kind import SCALED_KIND

__version__ = "0.1"


@hookimpl
def register_drafter_kinds(register):
    register(SCALED_KIND.name, lambda: SCALED_KIND, description=SCALED_KIND.description)


@hookimpl
def register_drafters(register):
    register(SCALED_KIND.name, neural_drafter_factory(SCALED_KIND.name))
