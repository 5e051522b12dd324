"""The emulated kernel a lab host sees: its PCI bus, IOMMU groups and NVIDIA driver, served over FUSE.

``model.HostModel`` holds the state and the kernel's rules for changing it (errnos per kernel era),
``acs`` the ACS rules (bits at boot, groups, P2P routes), ``configspace`` what lspci/setpci read,
``sysfs``/``sysfs_tree`` the FUSE daemon and the files it serves, ``aer`` and ``infiniband`` the
counters and ports real drivers add, ``standalone`` a mount of it for tests.
"""
