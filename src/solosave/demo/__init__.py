"""The demo training job: the main job of ``make train`` (``solosave train``).

A small GPT trained on N CPU ranks with asynchronous solosave checkpoints, to show and measure the
library inside a real training loop. It is not part of the library API: nothing here is exported
by ``solosave``, and its modules may change without notice. Your own loop uses
:mod:`solosave.integrations` the way :mod:`solosave.demo.job` does.

- ``launch``: the entry point (``solosave train``, ``python -m solosave.demo``, ``torchrun -m``);
- ``args``: the job's flags; ``model``: the GPT; ``data``: corpus, batches, learning rate;
- ``job``: what each rank does; ``report``: rank 0's output.
"""
