"""Math environments: a final answer, compared on the host (`Answer`: exactly after
normalisation, numerically, or as MATH answers).

    ptrain.envs.math:arith   compute a <op> b with the python tool, then answer (generated)
    ptrain.envs.math:gsm8k   GSM8K files (train=..., heldout=...)
    ptrain.envs.math:math    MATH files
"""

from ptrain.envs import synthetic, task_files

arith = synthetic.arith
gsm8k = task_files.reader("gsm8k", "gsm8k")
math = task_files.reader("math", "math")
