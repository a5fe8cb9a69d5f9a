"""A spy on a native decode step's calls (kernels/rows.py AttentionStep, kernels/latent.py
LatentStep), for the tests that compare a step's numbers with the op-by-op path's."""


def step_calls(monkeypatch, step_class, blocks: list | None = None) -> list:
    """Each call's result (None: it declined, and the layer went op by op; a block's sum, [1, E] as
    a projecting step's output): a step made but declining would leave a test comparing the
    op-by-op path with itself. `blocks` gets whether each call was one."""
    calls, real = [], step_class.__call__

    def call(self, *a, block=False):
        out = real(self, *a, block=block)
        calls.append(out[0] if block and out is not None else out)
        if blocks is not None:
            blocks.append(block)
        return out
    monkeypatch.setattr(step_class, "__call__", call)
    return calls
