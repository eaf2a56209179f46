"""`dptrain launch` (commands.py) and `dptrain container` (container_commands.py): the command lines over
the schedulers and container runtimes of dptrain.cluster, which write, submit and follow the job."""
