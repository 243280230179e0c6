"""``python -m tether.runner TASKS_FD EVENTS_FD --worker=PID --id=ID``: a runner process (started by a worker)."""

from tether.runner.main import main

main()
