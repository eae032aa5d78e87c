"""Files and tools environments: judged by the files a script or the episode's tool calls
leave in the work dir (`Files`), or by ptrain task records of any built-in verifier.

    ptrain.envs.files:generated  a bash script that writes words to a file (the quickstart's)
    ptrain.envs.files:records    ptrain task files (train=..., heldout=..., tools=(...))
"""

from ptrain.envs import synthetic, task_files

generated = synthetic.files
records = task_files.reader("ptrain", "tasks")
