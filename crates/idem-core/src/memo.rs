//! [`Recent`]: the last few values a thread computed, by key.

/// The last `capacity` `(key, value)` pairs computed, oldest dropped first.
/// Meant for a handful of entries in a `thread_local!` (frozen contracts, for
/// example), where a linear scan beats hashing and no lock is needed.
#[derive(Debug)]
pub struct Recent<K, V> {
    entries: Vec<(K, V)>,
    capacity: usize,
}

impl<K, V> Recent<K, V> {
    /// An empty memo that keeps at most `capacity` entries (at least one).
    pub const fn new(capacity: usize) -> Recent<K, V> {
        Recent {
            entries: Vec::new(),
            capacity,
        }
    }

    /// The value of the first entry whose key `is_key` accepts; otherwise
    /// `make` computes a `(key, value)` pair, which is kept (dropping the
    /// oldest entry when full) and returned.
    ///
    /// # Errors
    /// `make`'s error; nothing is kept then.
    pub fn get_or_try_insert<E>(
        &mut self,
        is_key: impl Fn(&K) -> bool,
        make: impl FnOnce() -> Result<(K, V), E>,
    ) -> Result<&V, E> {
        let at = match self.entries.iter().position(|(k, _)| is_key(k)) {
            Some(at) => at,
            None => {
                let entry = make()?;
                if self.entries.len() >= self.capacity.max(1) {
                    self.entries.remove(0);
                }
                self.entries.push(entry);
                self.entries.len() - 1
            }
        };
        Ok(&self.entries[at].1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hits answer without computing, misses compute once and are kept, the
    /// oldest entry goes first, and a failed computation keeps nothing.
    #[test]
    fn keeps_the_latest_entries() {
        let mut memo: Recent<u32, String> = Recent::new(2);
        let mut made = 0;
        let mut get = |memo: &mut Recent<u32, String>, k: u32| -> Result<String, ()> {
            memo.get_or_try_insert(
                |key| *key == k,
                || {
                    made += 1;
                    Ok((k, format!("v{k}")))
                },
            )
            .cloned()
        };
        assert_eq!(get(&mut memo, 1), Ok("v1".into()));
        assert_eq!(get(&mut memo, 1), Ok("v1".into()));
        assert_eq!(get(&mut memo, 2), Ok("v2".into()));
        assert_eq!(get(&mut memo, 3), Ok("v3".into()));
        assert_eq!(get(&mut memo, 2), Ok("v2".into()));
        assert_eq!(get(&mut memo, 1), Ok("v1".into()));
        // 1, 2, 3 and 1 again (dropped when 3 came): four computations.
        assert_eq!(made, 4);
        let failed: Result<&String, &str> = memo.get_or_try_insert(|k| *k == 9, || Err("no"));
        assert_eq!(failed, Err("no"));
        assert_eq!(memo.entries.len(), 2);
    }
}
