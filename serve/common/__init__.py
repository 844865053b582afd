"""Helpers with no layer of their own, shared by the build, the pod and the tools.

* :mod:`~serve.common.net`: loopback ports and waiting for servers.
* :mod:`~serve.common.clilog`: logging set-up for the command-line entry points.
* :mod:`~serve.common.cpu`: the process's CPU budget (cgroup quota) and thread counts.
* :mod:`~serve.common.zipf`: Zipf-distributed ids (training data and load tests).
* :mod:`~serve.common.quality`: ROC AUC and calibration (numpy only).
* :mod:`~serve.common.validate`: the shared checks of settings and values (one message shape).
* :mod:`~serve.common.durable`: atomic writes that survive a crash (fsync of file and folder).
* :mod:`~serve.common.histograms`: Prometheus' ``histogram_quantile`` and the PSI of two
  binned distributions.
"""
