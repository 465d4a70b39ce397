"""The exit statuses of `pagefleet run` (and the other commands), one owner for each meaning.

0    every batch is done (or the command did what it was asked)
1    the run finished, but some batches ended `failed` (rerunning retries them)
2    the run could not start, or stopped on a fault: a configuration or input error, a corrupt run directory,
     a fault of the head itself, or a run that produced no sample at all
130  interrupted (Ctrl-C or SIGTERM); rerunning the same command resumes
"""

OK = 0
BATCHES_FAILED = 1
FAULT = 2
INTERRUPTED = 130
