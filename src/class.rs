//! Size classes: the mapping from a request's byte count to the cached block size that serves
//! it, and back.
//!
//! The caching tiers keep free blocks per class, so this mapping decides both how often a
//! freed block can be reused (fewer classes, more reuse) and how many bytes each block wastes
//! (more classes, less waste). Classes are geometric with 8 per doubling everywhere, which
//! bounds rounding waste at 12.5% of the request while keeping the whole range from 256 B to
//! 1 GiB in 160 classes. Below 2 KiB an eighth of a doubling would be under the device
//! alignment, so the classes there are the 256-byte multiples instead:
//!
//! ```text
//! 256, 512, ..., 2048           step 256 (8 classes)
//! 2048 -> 4096                  step 256
//! 4096 -> 8192                  step 512
//! 2^k  -> 2^(k+1)               step 2^(k-3)
//! ```
//!
//! The mapping is computed, not searched: [`class_of`] sits on every allocation's fast path.

/// The smallest class, and the step of every class size: the device alignment.
pub const MIN_CLASS: u64 = 256;

/// The largest class size any pool can be configured with.
pub const MAX_CLASS_SIZE: u64 = 1 << 30;

/// The number of classes up to and including [`MAX_CLASS_SIZE`].
pub const MAX_CLASSES: usize = 160;

/// The largest cached class a pool uses unless configured otherwise. A block cached in a
/// busy thread's cache is memory no other thread's request can use, and the larger the
/// block the less a hit saves next to the device work it is allocated for; why 4 MiB and
/// not the 64 MiB of earlier versions is in `IMPLEMENTATION.md` (T1 and T0).
pub const DEFAULT_LARGEST_CLASS: u64 = 4 << 20;

/// log2 of [`MIN_CLASS`]: requests are counted in 256-byte units.
const UNIT_SHIFT: u32 = MIN_CLASS.trailing_zeros();

/// log2 of the classes per doubling.
const SUB_BITS: u32 = 3;

/// The classes per doubling.
const SUB: u64 = 1 << SUB_BITS;

/// Every class's size in bytes, built by the inverse of [`class_of`]'s formula so the table
/// and the formula can be checked against each other.
const CLASS_SIZES: [u64; MAX_CLASSES] = {
    let mut sizes = [0u64; MAX_CLASSES];
    let mut c = 0;
    while c < MAX_CLASSES {
        let c64 = c as u64;
        let units = if c64 < SUB {
            c64 + 1
        } else {
            // Class c is the (c % 8)-th eighth of the doubling starting at 8 << (c/8 - 1)
            // units; its size is the top of that eighth.
            (SUB + c64 % SUB + 1) << (c64 / SUB - 1)
        };
        sizes[c] = units << UNIT_SHIFT;
        c += 1;
    }
    sizes
};

// The largest class must be exactly the advertised maximum, or MAX_CLASSES is miscounted.
const _: () = assert!(CLASS_SIZES[MAX_CLASSES - 1] == MAX_CLASS_SIZE);
// The pool hands out blocks aligned to its ALIGN; class sizes must keep them so.
const _: () = assert!(MIN_CLASS == crate::ALIGN);

/// The class of a request of `bytes`: the smallest class whose size is at least `bytes`.
/// None for 0 bytes or more than [`MAX_CLASS_SIZE`].
#[inline]
pub fn class_of(bytes: u64) -> Option<usize> {
    if bytes == 0 || bytes > MAX_CLASS_SIZE {
        return None;
    }
    // v = ceil(bytes / 256) - 1: the last unit the request touches, counted from 0.
    let v = (bytes - 1) >> UNIT_SHIFT;
    // e = floor(log2 v), but at least 3: OR-ing in 8 makes the linear classes (v < 8) fall
    // into the first doubling's formula with a shift of 0, so there is no branch.
    let e = (u64::BITS - 1 - (v | SUB).leading_zeros()) as u64;
    let shift = e - SUB_BITS as u64;
    // v >> shift is v's eighth of its doubling plus 8 (v's top four bits); each earlier
    // doubling contributed 8 classes.
    Some((shift * SUB + (v >> shift)) as usize)
}

/// The size in bytes of class `c`, or None if there is no such class.
#[inline]
pub fn class_size(c: usize) -> Option<u64> {
    CLASS_SIZES.get(c).copied()
}

/// The size in bytes of class `c`, for callers that hold a class from [`class_of`] and so
/// know it exists. Returns 0, which no class has, for a class that does not exist: a caller's
/// bug then shows as an empty block instead of a panic on the allocation path.
#[inline]
pub fn size_of_class(c: usize) -> u64 {
    class_size(c).unwrap_or(0)
}

/// How many classes a pool whose largest cached class is `largest` bytes has: the classes up
/// to and including the one a request of `largest` bytes falls in. 0 for 0; a `largest`
/// beyond [`MAX_CLASS_SIZE`] is capped there.
pub fn classes_up_to(largest: u64) -> usize {
    match class_of(largest.min(MAX_CLASS_SIZE)) {
        Some(c) => c + 1,
        None => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The class the definition names: the smallest whose size is at least `bytes`, found by
    /// scanning the table, so the formula is checked against something it does not share.
    fn smallest_fitting(bytes: u64) -> Option<usize> {
        CLASS_SIZES.iter().position(|&s| s >= bytes).filter(|_| bytes > 0)
    }

    fn sizes() -> impl Iterator<Item = u64> {
        (0..MAX_CLASSES).map(|c| class_size(c).unwrap())
    }

    #[test]
    fn the_first_classes_are_the_256_byte_multiples_up_to_2_kib() {
        let first: Vec<u64> = sizes().take(9).collect();
        assert_eq!(first, [256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2304]);
    }

    #[test]
    fn classes_grow_strictly_and_are_multiples_of_the_alignment() {
        let all: Vec<u64> = sizes().collect();
        assert_eq!(all[0], MIN_CLASS);
        assert!(all.windows(2).all(|w| w[0] < w[1]), "class sizes must strictly increase");
        assert!(all.iter().all(|s| s % MIN_CLASS == 0));
        assert_eq!(*all.last().unwrap(), MAX_CLASS_SIZE);
    }

    #[test]
    fn every_doubling_above_2_kib_holds_eight_classes() {
        for k in 11..30 {
            let (lo, hi) = (1u64 << k, 1u64 << (k + 1));
            let n = sizes().filter(|&s| s > lo && s <= hi).count();
            assert_eq!(n, 8, "doubling ({lo}, {hi}]");
            // ...evenly spaced, so the waste bound holds across the whole doubling.
            let step = lo / 8;
            assert!(sizes().filter(|&s| s > lo && s <= hi).all(|s| s % step == 0));
        }
    }

    #[test]
    fn each_class_boundary_maps_to_the_smallest_class_that_fits() {
        for c in 0..MAX_CLASSES {
            let s = class_size(c).unwrap();
            assert_eq!(class_of(s - 1), Some(c), "size {s} - 1");
            assert_eq!(class_of(s), Some(c), "size {s}");
            assert_eq!(class_of(s + 1), if c + 1 < MAX_CLASSES { Some(c + 1) } else { None }, "size {s} + 1");
            // The whole class maps to it: everything above the previous class's size.
            let prev = if c == 0 { 0 } else { class_size(c - 1).unwrap() };
            assert_eq!(class_of(prev + 1), Some(c), "first byte count of class {c}");
        }
    }

    #[test]
    fn every_byte_count_up_to_1_mib_maps_to_the_smallest_class_that_fits() {
        // Walk the expected class alongside the byte count instead of searching per count,
        // which keeps a million checks fast in debug builds.
        let mut expected = 0;
        for b in 1..=(1u64 << 20) {
            while class_size(expected).unwrap() < b {
                expected += 1;
            }
            assert_eq!(class_of(b), Some(expected), "{b} bytes");
        }
    }

    #[test]
    fn the_formula_agrees_with_a_table_scan_across_the_whole_range() {
        // Every class's interior at a few points, up to 1 GiB, against the independent scan.
        for c in 0..MAX_CLASSES {
            let hi = class_size(c).unwrap();
            let lo = if c == 0 { 1 } else { class_size(c - 1).unwrap() + 1 };
            for b in [lo, lo + (hi - lo) / 3, lo + (hi - lo) / 2, hi] {
                assert_eq!(class_of(b), smallest_fitting(b), "{b} bytes");
            }
        }
    }

    #[test]
    fn class_of_never_decreases_as_requests_grow() {
        let mut last = 0;
        let mut b = 1u64;
        while b <= MAX_CLASS_SIZE {
            let c = class_of(b).unwrap();
            assert!(c >= last, "{b} bytes went from class {last} down to {c}");
            last = c;
            b += 1 + b / 97; // dense at the bottom, geometric above
        }
    }

    #[test]
    fn rounding_wastes_at_most_an_eighth_above_2_kib_and_under_256_bytes_below() {
        let check = |b: u64| {
            let waste = size_of_class(class_of(b).unwrap()) - b;
            if b > 2048 {
                assert!(waste <= b / 8, "{b} bytes waste {waste}");
            } else {
                assert!(waste < MIN_CLASS, "{b} bytes waste {waste}");
            }
        };
        (1..=(64u64 << 10)).for_each(check);
        // The worst case of each class is one byte past the class below it.
        for c in 1..MAX_CLASSES {
            check(class_size(c - 1).unwrap() + 1);
        }
    }

    #[test]
    fn a_default_pool_caches_96_classes_up_to_4_mib() {
        assert_eq!(classes_up_to(DEFAULT_LARGEST_CLASS), 96);
        assert_eq!(class_size(95), Some(4 << 20));
        assert_eq!(classes_up_to(64 << 20), 128);
        assert_eq!(class_size(127), Some(64 << 20));
    }

    #[test]
    fn classes_up_to_counts_the_class_that_holds_the_largest_request() {
        assert_eq!(classes_up_to(0), 0);
        assert_eq!(classes_up_to(1), 1);
        assert_eq!(classes_up_to(256), 1);
        assert_eq!(classes_up_to(257), 2);
        assert_eq!(classes_up_to(MAX_CLASS_SIZE), MAX_CLASSES);
        assert_eq!(classes_up_to(u64::MAX), MAX_CLASSES);
        for c in 0..MAX_CLASSES {
            assert_eq!(classes_up_to(class_size(c).unwrap()), c + 1);
        }
    }

    #[test]
    fn out_of_range_requests_and_classes_have_no_answer() {
        assert_eq!(class_of(0), None);
        assert_eq!(class_of(MAX_CLASS_SIZE + 1), None);
        assert_eq!(class_of(u64::MAX), None);
        assert_eq!(class_of(u64::MAX - 255), None);
        assert_eq!(class_of(1 << 63), None);
        assert_eq!(class_size(MAX_CLASSES), None);
        assert_eq!(class_size(usize::MAX), None);
        assert_eq!(size_of_class(MAX_CLASSES), 0);
        assert_eq!(size_of_class(usize::MAX), 0);
    }
}
