"""Code environments: the model writes a program, judged in the sandbox by unit tests
(`UnitTests`) or stdin/stdout cases (`Stdio`).

    ptrain.envs.code:generated     write name(x) returning x <op> k (the quickstart's)
    ptrain.envs.code:humaneval     HumanEval files (train=..., heldout=...)
    ptrain.envs.code:mbpp          MBPP files
    ptrain.envs.code:apps          APPS files (stdin/stdout, or call-based unit tests)
    ptrain.envs.code:codecontests  CodeContests files
"""

from ptrain.envs import synthetic, task_files

generated = synthetic.code
humaneval = task_files.reader("humaneval", "humaneval")
mbpp = task_files.reader("mbpp", "mbpp")
apps = task_files.reader("apps", "apps")
codecontests = task_files.reader("codecontests", "codecontests")
