"""Checkpoints, used by the training loop and the tools alike.

    dcp_io.py    save and load with torch.distributed.checkpoint under layout-independent names (a run saved
                 at one layout resumes at another); complete-or-absent directories; `latest`
    manifest.py  every file checksummed at save and verified before a resume; which checkpoint to resume
                 from (and what to fall back to)
    initial.py   starting weights from a Hugging Face model directory or another run, at any layout
    background.py  saves written in the background (checkpoint.async_save): staged into a pinned arena the plan
                 counts, written by DCP's async_save while training goes on, completed as dcp_io completes a save

It sits below the model in the README's code map and imports nothing of training or the tools.
"""
