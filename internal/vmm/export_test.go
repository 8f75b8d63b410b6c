package vmm

// BootProbe exposes the probe boot so tests exercise it under TCG on hosts without KVM.
var BootProbe = bootProbe
