"""The trainer in parts, one job each (``python -m lbannpy.train`` strings them together):

* :mod:`.build`    -- config -> model, loss, readers, optimizer (:func:`build`);
* :mod:`.gradsync` -- gradient synchronisation: the overlap engine and the replicated-FC policy;
* :mod:`.loop`     -- the step loop (:class:`Trainer`): steps, evaluation, checkpoints, the progress bar;
* :mod:`.report`   -- metrics rows, ``metrics.csv``, ``summary.json``, ``loss.png``, the Chrome trace;
* :mod:`.clock`    -- the one clock every step timing is read from;
* :mod:`.watchdog` -- the no-progress abort.
"""
