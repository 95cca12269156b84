//! [`FrozenContract`]: a task's contract (SPEC §2.9) as it is shared and
//! stored, with its JSON text and its content id ([`ContractId`]).
//!
//! A contract is frozen per operation class and configuration version, so a
//! process sees only a few: each is serialized and hashed once, and the tasks
//! accepted under it share one allocation. Stores keep one row per distinct
//! contract, keyed by its content id, and a task row names that id.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use crate::config::Contract;

/// The content id of a contract: SHA-256 of its JSON text (32 bytes), the key
/// of its stored row. Equal texts have equal ids, so the tasks of one class
/// and configuration version name one row, and two processes (or two
/// databases) agree on the id without asking each other.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContractId(pub [u8; 32]);

impl ContractId {
    /// The id of the contract whose JSON text is `json`.
    pub fn of(json: &str) -> ContractId {
        ContractId(Sha256::digest(json.as_bytes()).into())
    }

    /// The 32 bytes, as stored.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The id stored as `bytes`, or `None` when they are not 32 bytes long.
    pub fn from_slice(bytes: &[u8]) -> Option<ContractId> {
        bytes.try_into().ok().map(ContractId)
    }
}

impl fmt::Debug for ContractId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContractId({})", hex::encode(self.0))
    }
}

/// A frozen [`Contract`], shared: cloning it copies a pointer. It carries the
/// contract's JSON text (`serde_json`'s rendering, which a task's JSON embeds
/// verbatim) and the [`ContractId`] of its stored row. Two are equal when
/// their ids are.
#[derive(Clone)]
pub struct FrozenContract(Arc<Frozen>);

struct Frozen {
    contract: Contract,
    json: Box<RawValue>,
    id: ContractId,
}

impl FrozenContract {
    /// Freezes `contract`: its JSON text and the SHA-256 of that text.
    ///
    /// # Errors
    /// When the contract cannot be serialized (not expected: it holds only
    /// numbers, strings, booleans and a JSON document).
    pub fn new(contract: Contract) -> Result<FrozenContract, serde_json::Error> {
        let json = serde_json::value::to_raw_value(&contract)?;
        let id = ContractId::of(json.get());
        Ok(FrozenContract(Arc::new(Frozen { contract, json, id })))
    }

    /// The contract stored under `id` as the JSON text `stored`. The text a
    /// task's JSON carries is the decoded contract serialized again, as for a
    /// contract frozen now; `id` stays the stored row's.
    ///
    /// # Errors
    /// The JSON error when `stored` is not a contract.
    pub fn decode(id: ContractId, stored: &str) -> Result<FrozenContract, serde_json::Error> {
        let contract: Contract = serde_json::from_str(stored)?;
        let json = serde_json::value::to_raw_value(&contract)?;
        Ok(FrozenContract(Arc::new(Frozen { contract, json, id })))
    }

    /// The content id of its stored row.
    pub fn id(&self) -> ContractId {
        self.0.id
    }

    /// The content id's 32 bytes, borrowed from the contract.
    pub fn id_bytes(&self) -> &[u8] {
        &self.0.id.0
    }

    /// Its JSON text, as stored.
    pub fn json(&self) -> &str {
        self.0.json.get()
    }
}

impl std::ops::Deref for FrozenContract {
    type Target = Contract;
    fn deref(&self) -> &Contract {
        &self.0.contract
    }
}

impl PartialEq for FrozenContract {
    fn eq(&self, other: &FrozenContract) -> bool {
        self.0.id == other.0.id
    }
}

impl Eq for FrozenContract {}

impl fmt::Debug for FrozenContract {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.contract.fmt(f)
    }
}

impl Serialize for FrozenContract {
    /// The stored JSON text, embedded verbatim.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.json.serialize(s)
    }
}

impl<'de> Deserialize<'de> for FrozenContract {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        FrozenContract::new(Contract::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A frozen contract serializes exactly as its contract does, its id is
    /// the SHA-256 of that text, and decoding the text gives the same
    /// contract and id; contracts that differ have different ids.
    #[test]
    fn frozen_contracts_carry_their_text_and_id() {
        let config = crate::config::Config::bundled().unwrap();
        let mut ids = std::collections::HashSet::new();
        for class in config.operations.keys() {
            for price in [1, 2] {
                let mut contract = config.contract(class).unwrap();
                contract.price = price;
                let text = serde_json::to_string(&contract).unwrap();
                let frozen = FrozenContract::new(contract.clone()).unwrap();
                assert_eq!(serde_json::to_string(&frozen).unwrap(), text);
                assert_eq!(frozen.json(), text);
                assert_eq!(frozen.id(), ContractId::of(&text));
                assert_eq!(*frozen, contract);
                let decoded = FrozenContract::decode(frozen.id(), &text).unwrap();
                assert_eq!(decoded, frozen);
                assert_eq!(*decoded, contract);
                assert_eq!(decoded.json(), text);
                let back: FrozenContract = serde_json::from_str(&text).unwrap();
                assert_eq!(back, frozen);
                assert!(ids.insert(frozen.id()));
            }
        }
        assert!(FrozenContract::decode(ContractId([0; 32]), "not json").is_err());
        assert_eq!(ContractId::from_slice(&[1; 32]), Some(ContractId([1; 32])));
        assert_eq!(ContractId::from_slice(&[1; 31]), None);
    }
}
