"""The errors moefit raises on purpose. The CLI maps them to exit codes in one place."""


class MoefitError(Exception):
    """An error a user can act on; its message is the whole explanation."""

    exit_code = 1


class UsageError(MoefitError):
    exit_code = 2


class PackError(MoefitError):
    """A pack that cannot be read: names the file and, for a bad blob, the (layer, expert)."""


class RefusedError(MoefitError):
    """The plan does not fit the card: the message carries the ledger and the fixes."""

    exit_code = 3

    def __init__(self, message: str, plan=None):
        super().__init__(message)
        self.plan = plan


class DirtyCardError(MoefitError):
    """The zero check found the card dirty and the operator asked to refuse."""

    exit_code = 4


class DeviceOutOfMemory(MoefitError):
    """An allocation past the device's free memory (CUDA, or a simulated card)."""


class DeviceUnavailable(MoefitError):
    """The device source is missing (no NVML, no CUDA, an unreadable card file)."""
