//! The registry from Rust, as a server that shares the C ABI's pools uses it. One test:
//! the registry is process-wide and configured once.

use vrampool::registry::{self, Config, DeviceChoice};
use vrampool::{Device, DeviceKind, Error};

#[test]
fn one_configuration_one_pool_per_device_and_streams_by_handle() {
    let config = Config { device: DeviceChoice::Sim, sim_bytes: 1 << 30, sim_devices: 2, ..Config::default() };
    registry::configure(config.clone()).unwrap();
    assert!(matches!(registry::configure(config.clone()), Err(Error::NotPermitted(_))), "configured once");
    assert_eq!(registry::config().unwrap(), &config);
    assert_eq!(registry::device_kind().unwrap(), DeviceKind::Simulated);

    // One pool per ordinal, made on first use and kept: clones share it.
    let p0 = registry::pool(0).unwrap();
    let s0 = registry::default_stream(0).unwrap();
    let b = p0.alloc(1 << 20, &s0).unwrap();
    assert_eq!(registry::pool(0).unwrap().stats().allocated_bytes, 1 << 20);
    assert_eq!(registry::device(0).unwrap().total_memory(), 1 << 30);
    let p1 = registry::pool(1).unwrap();
    assert_ne!(p0.address_range(), p1.address_range(), "each device its own pool");
    assert!(matches!(registry::pool(2), Err(Error::NoDevice(_))), "two simulated devices");
    assert!(matches!(registry::pool(64), Err(Error::InvalidArgument(_))));
    assert_eq!(registry::pools().len(), 2);

    // A handle names one stream for the life of the process, on its own device.
    // SAFETY: the simulator takes any stream value.
    let (a, a2, other) = unsafe {
        (registry::stream(0, 0x77).unwrap(), registry::stream(0, 0x77).unwrap(), registry::stream(1, 0x77).unwrap())
    };
    assert_eq!(a, a2);
    assert_ne!(a, other);
    assert_ne!(a, s0);
    // SAFETY: as above.
    assert_eq!(unsafe { registry::stream(0, 0) }.unwrap(), s0, "NULL is the default stream");

    drop(b);
    registry::trim().unwrap();
    assert_eq!(p0.stats().allocated_bytes, 0);
    assert_eq!(p0.stats().reserved_bytes, 0);
    p0.check().unwrap();
}
