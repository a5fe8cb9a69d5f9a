"""One module per command; each registers its parser and a `run(args)` function."""

from moefit.commands import doctor, generate, history, pack, plan, profile, serve, train_draft, verify


def register_all(sub) -> None:
    for module in (pack, verify, generate, plan, profile, serve, doctor, history, train_draft):
        module.register(sub)
