# Run inside the VM (busybox sh). One line per behaviour: KEY VALUE.
# w FILE VALUE: write like echo, print ok or the errno text busybox reports.
w() { r=$( (echo "$2" > "$1") 2>&1 ); if [ -z "$r" ]; then echo ok; else echo "$r" | sed 's/.*: //' | tr ' ' _; fi; }
S=/sys/bus/pci/devices
grp() { basename $(readlink $S/$1/iommu_group); }
G1=$(grp 0000:01:00.0)   # e1000e behind the ACS root port: its own group
GB=$(grp 0000:04:01.0)   # e1000 behind the pcie-pci-bridge: a multi-device group
T=/sys/kernel/iommu_groups
echo "single_bound_initial $(cat $T/$G1/type)"
echo "single_bound_identity $(w $T/$G1/type identity)"
echo "single_bound_readback $(cat $T/$G1/type)"
for d in 0000:04:01.0 0000:04:02.0; do [ -e $S/$d/driver ] || echo $d > /sys/bus/pci/drivers/e1000/bind; done
echo "multi_members_bound $(ls -d $S/0000:04:0?.0/driver | wc -l)"
echo "multi_bound_identity $(w $T/$GB/type identity)"
for d in 0000:04:01.0 0000:04:02.0; do echo $d > $S/$d/driver/unbind; done
echo "multi_unbound_identity $(w $T/$GB/type identity)"
echo 0000:01:00.0 > $S/0000:01:00.0/driver/unbind
echo "unbind_driver_link $( [ -e $S/0000:01:00.0/driver ] && echo present || echo absent)"
for v in identity DMA DMA-FQ auto; do
  echo "single_unbound_$v $(w $T/$G1/type $v) $(cat $T/$G1/type)"
done
echo "bind_write $(w /sys/bus/pci/drivers/e1000e/bind 0000:01:00.0)"
echo "bind_driver_link $(basename $(readlink $S/0000:01:00.0/driver))"
echo 0000:01:00.0 > $S/0000:01:00.0/driver/unbind
echo "override_write $(w $S/0000:01:00.0/driver_override e1000e)"
echo "override_probe $(w /sys/bus/pci/drivers_probe 0000:01:00.0) $(basename $(readlink $S/0000:01:00.0/driver))"
echo "remove_write $(w $S/0000:04:02.0/remove 1) $( [ -e $S/0000:04:02.0 ] && echo present || echo absent)"
echo "rescan_write $(w /sys/bus/pci/rescan 1) $( [ -e $S/0000:04:02.0 ] && echo present || echo absent)"
echo "tun_refcnt_0 $(cat /sys/module/tun/refcnt)"
exec 3<>/dev/net/tun; echo "tun_refcnt_open1 $(cat /sys/module/tun/refcnt)"
exec 4<>/dev/net/tun; echo "tun_refcnt_open2 $(cat /sys/module/tun/refcnt)"
sleep 5 & echo "tun_refcnt_fork $(cat /sys/module/tun/refcnt)"; kill $!; wait $! 2>/dev/null
exec 3>&- 4>&-; echo "tun_refcnt_closed $(cat /sys/module/tun/refcnt)"
echo "tun_node_type $(stat -c %F /dev/net/tun | tr ' ' _)"
echo "module_files $(ls /sys/module/tun | tr '\n' , )"
