"""One module per command; each registers its parser and a `run(args)` function."""

from moefit.commands import generate, pack, plan, profile


def register_all(sub) -> None:
    for module in (pack, generate, plan, profile):
        module.register(sub)
