"""Lab hosts as machines: namespaces, an overlay root, a real systemd and sshd, and their faults.

``lab.Lab``/``lab.LabHost`` bring hosts up and down; ``boot`` becomes a host's PID 1 and
``supervise`` boots it again on a reboot; ``netns``, ``cgroups``, ``procs``, ``units``, ``layer``,
``datatrees`` and ``delayproxy`` are the parts a host is made of.
"""
