//! loom model of the `sync` facade's promise: under `--cfg loom` the crate's atomics are
//! loom's, so a message passed with release/acquire through the crate's lock-free stack is
//! seen whole by the thread that takes it.
//!
//! `RUSTFLAGS="--cfg loom --cfg crossbeam_loom" LOOM_MAX_PREEMPTIONS=3 cargo test -p loom_tests --release --test facade`
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;
use vrampool::reclaim::Stack;

#[test]
fn items_pushed_by_one_thread_are_taken_whole_by_another() {
    loom::model(|| {
        let s: Arc<Stack<Box<[u64; 2]>>> = Arc::new(Stack::new());
        let s2 = s.clone();
        let t = thread::spawn(move || s2.push(Box::new([1, 2])));
        let mut got: Vec<_> = s.take_all().collect();
        t.join().unwrap();
        got.extend(s.take_all());
        assert_eq!(got.len(), 1);
        assert_eq!(*got[0], [1, 2]);
    });
}
